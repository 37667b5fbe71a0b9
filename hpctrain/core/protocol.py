"""The launcher <-> rank protocol: everything ``hpctrain run`` (and ``hpctrain slurm``'s batch
script) and the ranks it starts tell each other, through environment variables and small
files, without a connection. One module, so both sides read one definition:

* **signals** (:data:`SIGNALS_ENV`): the preemption signals a user's program handles, as
  ``hpctrain slurm --signal`` chose them;
* **outcome notes** (:data:`OUTCOME_ENV`, a node-local directory): the launcher notes each rank
  it saw end and each signal it forwarded (so a rank names the first cause of a failure, and
  honours a signal it ignored for a while); a rank that saved for a preemption notes it (so the
  launcher exits 3 for any program);
* **the relayed signal** (:data:`RELAY_ENV`): a signal the launcher kept before its ranks existed;
* **status.json** (:data:`STATUS`) in the run directory: the run's outcome, which a batch
  script and ``hpctrain slurm status`` read, and its exit code;
* **heartbeats** (:data:`HEARTBEAT_ENV`, a node-local directory): each rank's progress in a
  small mapped file the launcher's watchdog reads, and a stack dump on :data:`DUMP_SIGNAL`.

Core: no torch, no hpctrain module above ``core``.

**Heartbeats.** ``hpctrain run`` gives every rank a node-local directory (on ``/dev/shm``
where it exists). Each rank maps one small file there and, at every phase boundary of the
loop (:meth:`hpctrain.telemetry.meter.Meter.lap`), stores its laps, step, phase and the time
into it: a few memory stores, no system call, no collective. The launcher's watchdog
(:mod:`hpctrain.launch.watchdog`) reads the files; a rank that is stopped, deadlocked or stuck
in a collective stops updating its own.

Laps are the measure of progress: every rank of an SPMD loop passes the same phase
boundaries in the same order, so when the job stalls, the rank with the fewest laps is the
one the others wait for (they are at most one collective ahead of it).

Laps say where a rank is, not how long it may stay there: after a lap the loop may save,
validate or only agree on a preemption (one tiny all-reduce). So the loop marks its long
phases itself, with :func:`during` (validation, a checkpoint save, the resume read): the
watchdog gives only those its longer allowance; every other phase, the per-step preemption
agreement included, is judged at the plain timeout.

The rank's process registers a :mod:`faulthandler` dump on :data:`DUMP_SIGNAL`, so the
watchdog can ask it for every thread's Python stack even while its main thread is blocked in
C++ (faulthandler writes from the signal handler; the GIL is not needed).
"""

from __future__ import annotations

import faulthandler
import json
import mmap
import os
import re
import signal
import struct
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from hpctrain.core.atomic import write_json
from hpctrain.core.env import launched_rank, restart_count
from hpctrain.core.errors import EXIT_PREEMPTED, RunError, describe

# ---------------------------------------------------------------- signals

# The preemption signals a user's program handles (hpctrain.checkpoint.preempt.Preemption's
# default), as hpctrain slurm --signal chose them: "SIGHUP,SIGTERM".
SIGNALS_ENV = "HPCTRAIN_SIGNALS"
# A signal the launcher kept before its ranks existed: they inherit its name and honour it.
RELAY_ENV = "HPCTRAIN_PREEMPTED_BY"


def program_signals(default: list[str], environ: Mapping[str, str] | None = None) -> list[str]:
    """The preemption signals of a user's program: hpctrain slurm's choice, else ``default``."""
    chosen = (os.environ if environ is None else environ).get(SIGNALS_ENV, "")
    return [name for name in chosen.split(",") if name] or list(default)


# ---------------------------------------------------------------- outcome notes

# The node-local directory `hpctrain run` gives its ranks for their outcome notes (a preemption
# save, a rank's first failure): what the launcher reads to choose its exit code. The launcher
# writes ended-<restart>-rank-<rank> (its exit code) and forwarded-<restart>-<SIGNAL>; a rank
# that saved for a preemption writes rank-<rank>.
OUTCOME_ENV = "HPCTRAIN_OUTCOME_DIR"
_ENDED, _FORWARDED = "ended-", "forwarded-"


def note_ended(directory: Path, restart: str, rank: int, code: int) -> None:
    """The launcher: rank ``rank`` of attempt ``restart`` ended with ``code`` (negative: the signal)."""
    (directory / f"{_ENDED}{restart}-rank-{rank}").write_text(str(code))


def note_forwarded(directory: Path, restart: str, name: str) -> None:
    """The launcher: it forwards signal ``name`` to the ranks of attempt ``restart`` now."""
    (directory / f"{_FORWARDED}{restart}-{name}").touch()


def forwarded_signals(environ: Mapping[str, str] | None = None) -> set[str]:
    """The signals ``hpctrain run`` forwarded to this attempt's ranks so far (names); empty
    outside ``hpctrain run``. A rank that ignored one for a while can still honour it."""
    env = os.environ if environ is None else environ
    directory = env.get(OUTCOME_ENV)
    if not directory:
        return set()
    prefix = f"{_FORWARDED}{restart_count(env)}-"
    return {note.name[len(prefix):] for note in Path(directory).glob(f"{prefix}SIG*")}


def ended_ranks(environ: Mapping[str, str] | None = None) -> dict[int, int]:
    """The other ranks of this attempt that the launcher saw end with a failure (not a
    preemption's 3): rank -> exit code (negative: the signal). Empty outside ``hpctrain run``."""
    env = os.environ if environ is None else environ
    directory = env.get(OUTCOME_ENV)
    if not directory:
        return {}
    own, prefix = str(launched_rank(env)), f"{_ENDED}{restart_count(env)}-rank-"
    found: dict[int, int] = {}
    for note in Path(directory).glob(f"{prefix}*"):
        try:
            rank, code = note.name[len(prefix):], int(note.read_text())
        except (OSError, ValueError):
            continue  # being written
        if rank != own and rank.isdigit() and code not in (0, EXIT_PREEMPTED):
            found[int(rank)] = code
    return found


def ending(code: int) -> str:
    """``signal 9 (SIGKILL)`` or ``exit code 2``."""
    if code < 0:
        try:
            return f"signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def named_peer_failure(err: BaseException, environ: Mapping[str, str] | None = None, *,
                       killed_only: bool = False) -> RunError | None:
    """A :class:`RunError` naming the rank the launcher saw end first (a death by a signal
    before an exit: the likeliest first cause, the others followed it); None if none did
    (``killed_only``: none was killed by a signal)."""
    ended = {rank: code for rank, code in ended_ranks(environ).items() if code < 0 or not killed_only}
    if not ended:
        return None
    rank, code = min(ended.items(), key=lambda item: (item[1] >= 0, item[0]))
    return RunError(f"rank {rank} ended with {ending(code)}, so this rank failed too ({one_line(err)}); hint: that "
                    "rank's log (and the OOM killer's: `dmesg`, `sacct -j JOB`) says why")


def one_line(err: BaseException) -> str:
    """A secondary error, short: its first line without a C++ source location, cut at 160."""
    text = re.sub(r"\[[^\]]*\.(cc|cpp|h):\d+\] ", "", describe(err).strip())
    line = text.splitlines()[0] if text else type(err).__name__
    return line if len(line) <= 160 else line[:157] + "..."


def record_preempted(environ: Mapping[str, str] | None = None) -> None:
    """Tell ``hpctrain run`` this rank saved for a preemption and is about to exit 3."""
    env = os.environ if environ is None else environ
    directory = env.get(OUTCOME_ENV)
    if directory:
        Path(directory, f"rank-{launched_rank(env)}").write_text("preempted")


def all_preempted(directory: Path, nproc: int) -> bool:
    """Did every one of this node's ``nproc`` ranks record a preemption?"""
    return len([p for p in directory.glob("rank-*") if p.read_text() == "preempted"]) >= nproc


# ---------------------------------------------------------------- status.json

STATUS = "status.json"


def write_status(run_dir: Path, outcome: str, **extra: Any) -> None:
    """The run's outcome (running, finished, failed, preempted, hung) and the time, written whole."""
    write_json(Path(run_dir) / STATUS, {"outcome": outcome, "time": time.time(), **extra})


def read_status(run_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((Path(run_dir) / STATUS).read_text())
    except (OSError, ValueError):
        return {}


def exit_code(outcome: str | None) -> int:
    return EXIT_PREEMPTED if outcome == "preempted" else 0


# ---------------------------------------------------------------- heartbeats

HEARTBEAT_ENV = "HPCTRAIN_HEARTBEAT_DIR"
# A real-time signal: no library uses it, and its default action (terminate) never applies,
# because the watchdog signals only ranks whose heartbeat file exists, i.e. after registration.
DUMP_SIGNAL = signal.SIGRTMIN + 5 if hasattr(signal, "SIGRTMIN") else None
_MAGIC = b"HPHB"
# magic, rank, restart, pid, phase, laps, step, steps done by this process, time
# (CLOCK_MONOTONIC: one clock for every process of a host, immune to wall-clock jumps)
_FORMAT = struct.Struct("<4siiiiqqqd")
_SIZE = 64

# Phases beyond the meter's (hpctrain.telemetry.meter: DATA..OTHER = 0..6): where no lap is.
STARTING, FINISHING = -1, 7
# The long phases the loop marks with during() (not laps: a mark is no progress).
VALIDATING, SAVING, RESUMING = 8, 9, 10
# What a rank does after the phase it lapped last (the meter laps a phase when it ends).
DOING_AFTER = {
    STARTING: "start-up or its first step (model, data, first batch)",
    0: "forward/backward (the batch is loaded)",
    1: "backward and the gradient all-reduce",
    2: "the optimizer step, or the next micro-batch's data",
    3: "the after-step hooks (profiler, straggler gather)",
    6: "the step's end (the preemption agreement, the checkpoint schedule's decision)",
    5: "the checkpoint schedule after validation (the preemption agreement)",
    4: "loading the next batch",
    FINISHING: "the final validation and save",
    VALIDATING: "validation",
    SAVING: "a checkpoint save",
    RESUMING: "the resume (reading a checkpoint)",
}
# Where a rank may be busy for long without a lap: the watchdog gives these more time (the
# first step too: compilation, FLOP counting). Start-up is not judged at all (see watchdog).
LONG_PHASES = frozenset({VALIDATING, SAVING, RESUMING, FINISHING})


@dataclass(frozen=True)
class Beat:
    """One rank's last heartbeat, as the watchdog reads it."""

    rank: int
    restart: int
    pid: int
    phase: int
    laps: int
    step: int
    done: int
    time: float

    @property
    def doing(self) -> str:
        return DOING_AFTER.get(self.phase, f"phase {self.phase}")


class Heartbeat:
    """The writer, one per rank process (see :func:`from_env`)."""

    def __init__(self, path: Path, rank: int, restart: int) -> None:
        self.path, self.rank, self.restart, self.pid = path, rank, restart, os.getpid()
        self.laps, self.step, self.done, self.phase = 0, 0, 0, STARTING
        tmp = path.with_name(f".{path.name}.{self.pid}")
        with open(tmp, "wb") as f:  # whole size first: a reader never maps a short file
            f.write(bytes(_SIZE))
        fd = os.open(tmp, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, _SIZE)
        finally:
            os.close(fd)
        self._store(STARTING)
        os.replace(tmp, path)  # appears complete, after the stack dump is registered

    def beat(self, phase: int) -> None:
        """A phase just ended (the meter's lap). The optimizer phase ends a step."""
        self.laps += 1
        if phase == 3:  # OPTIM
            self.step += 1
            self.done += 1
        self._store(phase)

    def at_step(self, step: int) -> None:
        """The loop (re)starts at ``step`` (after a resume)."""
        self.step = step

    def _store(self, phase: int) -> None:
        self.phase = phase
        _FORMAT.pack_into(self._map, 0, _MAGIC, self.rank, self.restart, self.pid, phase, self.laps, self.step,
                          self.done, time.monotonic())


def read_beat(path: Path) -> Beat | None:
    """A heartbeat file's content, or None if it is not (yet) one."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if len(data) < _FORMAT.size:
        return None
    magic, *fields = _FORMAT.unpack_from(data)
    return Beat(*fields) if magic == _MAGIC else None


def beat_path(directory: Path, rank: int) -> Path:
    return directory / f"rank-{rank}.beat"


def stack_path(directory: Path, rank: int) -> Path:
    return directory / f"rank-{rank}.stacks"


_current: Heartbeat | None = None
_stack_file: IO[str] | None = None


def from_env(environ: Mapping[str, str] | None = None) -> Heartbeat | None:
    """This process's heartbeat, opened on first use when the launcher asked for one
    (``HPCTRAIN_HEARTBEAT_DIR``); None otherwise. Cheap to call again."""
    global _current, _stack_file
    env = os.environ if environ is None else environ
    directory = env.get(HEARTBEAT_ENV)
    if _current is not None or not directory:
        return _current
    rank = launched_rank(env)
    if DUMP_SIGNAL is not None:  # before the file appears: the watchdog may signal from then on
        _stack_file = open(stack_path(Path(directory), rank), "w")  # noqa: SIM115 - kept open for the handler
        faulthandler.register(DUMP_SIGNAL, file=_stack_file, all_threads=True, chain=False)
    _current = Heartbeat(beat_path(Path(directory), rank), rank, restart_count(env))
    return _current


@contextmanager
def during(phase: int) -> Iterator[None]:
    """Mark a long phase (:data:`VALIDATING`, :data:`SAVING`, :data:`RESUMING`) for the
    watchdog, which then allows it ``LONG_FACTOR`` x the hang timeout; afterwards the phase
    before it again, counted from now. Nothing without ``hpctrain run``'s heartbeat."""
    beat = from_env()
    if beat is None:
        yield
        return
    before = beat.phase
    beat._store(phase)
    try:
        yield
    finally:
        beat._store(before)


def finishing() -> None:
    """After the loop: the final validation and save (a long phase) follow."""
    if _current is not None:
        _current._store(FINISHING)
