"""A rank's heartbeat: where the loop is, readable by the launcher without asking the rank.

``hpctrain run`` gives every rank a node-local directory (``HPCTRAIN_HEARTBEAT_DIR``, on
``/dev/shm`` where it exists). Each rank maps one small file there and, at every phase
boundary of the loop (:meth:`hpctrain.telemetry.meter.Meter.lap`), stores its laps, step,
phase and the time into it: a few memory stores, no system call, no collective. The
launcher's watchdog (:mod:`hpctrain.launch.watchdog`) reads the files; a rank that is
stopped, deadlocked or stuck in a collective stops updating its own.

Laps are the measure of progress: every rank of an SPMD loop passes the same phase
boundaries in the same order, so when the job stalls, the rank with the fewest laps is the
one the others wait for (they are at most one collective ahead of it).

Laps say where a rank is, not how long it may stay there: after a lap the loop may save,
validate or only agree on a preemption (one tiny all-reduce). So the loop marks its long
phases itself, with :func:`during` (validation, a checkpoint save, the resume read): the
watchdog gives only those its longer allowance; every other phase, the per-step preemption
agreement included, is judged at the plain timeout.

The same file registers a :mod:`faulthandler` dump on :data:`DUMP_SIGNAL`, so the watchdog
can ask a rank for every thread's Python stack even while its main thread is blocked in C++
(faulthandler writes from the signal handler; the GIL is not needed).
"""

from __future__ import annotations

import faulthandler
import mmap
import os
import signal
import struct
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

ENV_DIR = "HPCTRAIN_HEARTBEAT_DIR"
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


def read(path: Path) -> Beat | None:
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


def from_env(environ: dict[str, str] | None = None) -> Heartbeat | None:
    """This process's heartbeat, opened on first use when the launcher asked for one
    (``HPCTRAIN_HEARTBEAT_DIR``); None otherwise. Cheap to call again."""
    global _current, _stack_file
    env = os.environ if environ is None else environ
    directory = env.get(ENV_DIR)
    if _current is not None or not directory:
        return _current
    rank = int(env.get("RANK", "0"))
    if DUMP_SIGNAL is not None:  # before the file appears: the watchdog may signal from then on
        _stack_file = open(stack_path(Path(directory), rank), "w")  # noqa: SIM115 - kept open for the handler
        faulthandler.register(DUMP_SIGNAL, file=_stack_file, all_threads=True, chain=False)
    _current = Heartbeat(beat_path(Path(directory), rank), rank, int(env.get("TORCHELASTIC_RESTART_COUNT", "0")))
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
