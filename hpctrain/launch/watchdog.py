"""Hang detection in ``hpctrain run``: a bound, a diagnosis, then an end or a restart.

A thread of the launcher reads its ranks' heartbeats (:mod:`hpctrain.core.protocol`,
node-local files; no rendezvous, no collective of our own). When the job stalls every rank
stops beating: the ones that wait in a collective and the one they wait for. The laggard is
the rank with the fewest laps (ranks pass the same phase boundaries in the same order, and a
waiting rank is at most one collective ahead); a stopped process (state T) settles a tie.

When the laggard has made no progress for ``timeout_s`` (its first step and the long phases
the loop marks, validation, checkpoint saves and the resume read, get ``LONG_FACTOR`` times
that; every other phase, the per-step preemption agreement included, the plain timeout;
the rest of start-up is bounded by torch's rendezvous and ``parallel.init_timeout_s``
instead, because data staging may legitimately take long), the watchdog

1. writes every local rank's Python stacks (``py-spy dump`` where installed, else the rank's
   own faulthandler, which writes even while the main thread is blocked in C++), its process
   state and its last heartbeat into ``RUN_DIR/hang-<job>/``, and asks NCCL's flight recorder
   for a dump where one is running (CUDA builds; untested on this CPU-only machine);
2. logs one line naming the rank, host, step and phase;
3. SIGKILLs the local ranks: torch's agent then restarts them in place when
   ``--max-restarts`` allows (they resume from the last committed checkpoint), or the job
   ends with :data:`EXIT_HUNG`.

On several nodes each node's watchdog reports its own ranks into the shared hang directory
and names the laggard over every report it finds there.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hpctrain.core import protocol
from hpctrain.core.errors import EXIT_HUNG
from hpctrain.core.protocol import STARTING, Beat, write_status

log = logging.getLogger("hpctrain")

LONG_FACTOR = 3
_STATES = {"T": "stopped (SIGSTOP or a debugger)", "t": "stopped by a tracer", "D": "in uninterruptible I/O "
           "(a file system or a device)", "S": "sleeping (waiting)", "R": "running", "Z": "exited"}


@dataclass
class RankState:
    """One rank, as a hang report records it."""

    rank: int
    host: str
    pid: int
    step: int
    laps: int
    doing: str
    idle_s: float
    state: str
    stacks: str = ""

    @property
    def stopped(self) -> bool:
        return self.state.startswith("stopped")


@dataclass
class HangReport:
    directory: Path
    laggard: RankState
    ranks: list[RankState] = field(default_factory=list)

    def line(self) -> str:
        lag = self.laggard
        others = [r for r in self.ranks if r.rank != lag.rank]
        waiting = "; ".join(f"rank {r.rank} after step {r.step}, in {r.doing}" for r in others[:3])
        more = f" (+{len(others) - 3} more)" if len(others) > 3 else ""
        return (f"hang: rank {lag.rank} on {lag.host} (pid {lag.pid}) made no progress for {lag.idle_s:.0f} s, "
                f"after step {lag.step}, in {lag.doing}; process {lag.state}"
                + (f"; the others waited: {waiting}{more}" if others else "")
                + f". Stacks and heartbeats: {self.directory}")


def process_state(pid: int) -> str:
    """The kernel's word for what the process does now (``/proc/PID/stat``)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "exited"
    code = stat.rsplit(")", 1)[1].split()[0]  # after the command name, which may hold spaces
    return _STATES.get(code, f"state {code}")


def laggard(ranks: list[RankState]) -> RankState:
    """The rank the others wait for: fewest laps; a stopped process, then the longest idle, breaks a tie."""
    return min(ranks, key=lambda r: (r.laps, not r.stopped, -r.idle_s, r.rank))


def allowance(beat: Beat, timeout_s: float) -> float:
    """Seconds without a heartbeat before this rank counts as hung (inf: not judged). Only the
    phases the loop marks as long (protocol.during) and the first step get the long one."""
    if beat.phase == STARTING:
        return float("inf")
    if beat.done == 0 or beat.phase in protocol.LONG_PHASES:
        return timeout_s * LONG_FACTOR
    return timeout_s


class Watchdog:
    """Start with :meth:`start`; ``fired`` holds the last hang it acted on."""

    def __init__(self, beats: Path, timeout_s: float, run_dir: Path, tag: str, *, poll_s: float | None = None,
                 nnodes: int = 1) -> None:
        self.beats, self.timeout_s, self.run_dir, self.tag, self.nnodes = beats, timeout_s, run_dir, tag, nnodes
        self.poll_s = poll_s if poll_s is not None else min(5.0, max(0.2, timeout_s / 10))
        self.fired: HangReport | None = None
        self._min_restart = 0  # beats of an attempt already acted on are ignored
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="hpctrain-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.check(time.monotonic())
            except Exception:  # noqa: BLE001 - the watchdog must never take the launcher down
                log.exception("hang watchdog: check failed; hang detection is off for this run")
                return

    def live_beats(self) -> list[Beat]:
        found = (protocol.read_beat(p) for p in sorted(self.beats.glob("rank-*.beat")))
        return [b for b in found if b is not None and b.restart >= self._min_restart
                and process_state(b.pid) != "exited"]

    def check(self, now: float) -> HangReport | None:
        """One look at the heartbeats; acts and returns the report when the job is hung."""
        beats = self.live_beats()
        if not beats:
            return None
        fewest = min(b.laps for b in beats)
        behind = [b for b in beats if b.laps == fewest]
        if not any(now - b.time > allowance(b, self.timeout_s) for b in behind):
            return None
        report = self._report(beats, now)
        self._end(beats)
        print(f"hpctrain run: {report.line()}; its ranks on this node are ended (torchrun restarts them from "
              "the last committed checkpoint if --max-restarts allows)", file=sys.stderr, flush=True)
        self.fired, self._min_restart = report, max(b.restart for b in beats) + 1
        return report

    def _report(self, beats: list[Beat], now: float) -> HangReport:
        restart = max(b.restart for b in beats)
        directory = self.run_dir / f"hang-{self.tag}-restart{restart}"
        directory.mkdir(parents=True, exist_ok=True)
        host = socket.gethostname()
        _ask_flight_recorder(self.beats, beats)
        ranks = [RankState(b.rank, host, b.pid, b.step, b.laps, b.doing, round(now - b.time, 1), process_state(b.pid))
                 for b in beats]
        for state in ranks:
            state.stacks = python_stacks(self.beats, state)
            (directory / f"{host}-rank-{state.rank}.txt").write_text(_rank_text(state))
        _copy_flight_recorder(self.beats, directory, host)
        node_file = directory / f"{host}.json"
        node_file.write_text(json.dumps([_public(r) for r in ranks], indent=1))
        everyone = self._gather_nodes(directory, ranks)
        report = HangReport(directory, laggard(everyone), sorted(everyone, key=lambda r: r.rank))
        (directory / "summary.txt").write_text(report.line() + "\n")
        _write_status(self.run_dir, report)
        return report

    def _gather_nodes(self, directory: Path, own: list[RankState]) -> list[RankState]:
        """Every node's ranks found in the shared hang directory (waits briefly for the others)."""
        deadline = time.monotonic() + (min(30.0, 3 * self.poll_s + 5) if self.nnodes > 1 else 0)
        while True:
            files = list(directory.glob("*.json"))
            if len(files) >= self.nnodes or time.monotonic() >= deadline:
                break
            time.sleep(0.5)
        ranks = {r.rank: r for r in own}
        for f in files:
            try:
                for item in json.loads(f.read_text()):
                    ranks.setdefault(item["rank"], RankState(**item))
            except (OSError, ValueError, TypeError, KeyError):
                continue  # a node still writing its report: its ranks are left out
        return list(ranks.values())

    def _end(self, beats: list[Beat]) -> None:
        """SIGKILL the ranks and their children (a stopped data worker would never notice its
        rank's death)."""
        for pid in [p for b in beats for p in (*descendants(b.pid), b.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, children first (from /proc: no psutil needed)."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], list(parents.get(pid, []))
    while todo:
        child = todo.pop()
        found.append(child)
        todo.extend(parents.get(child, []))
    return found


def python_stacks(beats_dir: Path, rank: RankState, wait_s: float = 3.0) -> str:
    """Every thread's Python stack of a rank: its own faulthandler (always there, no ptrace
    permission needed, answers while the main thread is blocked in C++); for a stopped
    process, which cannot answer, ``py-spy dump`` where installed."""
    if not rank.stopped and protocol.DUMP_SIGNAL is not None:
        return _faulthandler_stacks(protocol.stack_path(beats_dir, rank.rank), rank.pid, wait_s)
    spy = shutil.which("py-spy")
    if spy:
        try:
            out = subprocess.run([spy, "dump", "--nonblocking", "--pid", str(rank.pid)], capture_output=True,
                                 text=True, timeout=30)
            if out.returncode == 0 and out.stdout.strip():
                return out.stdout
        except (OSError, subprocess.TimeoutExpired):
            pass
    return f"(no Python stack: the process is {rank.state}; py-spy, where installed and allowed to read it, can)"


def _faulthandler_stacks(path: Path, pid: int, wait_s: float) -> str:
    before = path.stat().st_size if path.exists() else 0
    assert protocol.DUMP_SIGNAL is not None
    os.kill(pid, protocol.DUMP_SIGNAL)
    deadline, size = time.monotonic() + wait_s, before
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now_size = path.stat().st_size if path.exists() else 0
        if now_size > before and now_size == size:  # grown, then quiet for one look: written
            break
        size = now_size
    with open(path, errors="replace") as f:
        f.seek(before)
        text = f.read()
    return text or f"(no answer to the stack request within {wait_s:.0f} s)"


def _write_status(run_dir: Path, report: HangReport) -> None:
    lag = report.laggard
    write_status(run_dir, "hung", rank=lag.rank, host=lag.host, step=lag.step, doing=lag.doing,
                 hang_dir=str(report.directory), exit_code=EXIT_HUNG)


def _rank_text(state: RankState) -> str:
    head = json.dumps({k: v for k, v in _public(state).items()}, indent=1)
    return f"{head}\n\n{state.stacks}"


def _public(state: RankState) -> dict[str, object]:
    return {k: v for k, v in asdict(state).items() if k != "stacks"}


# NCCL's flight recorder (torch's ProcessGroupNCCL): the launcher points its on-demand pipe
# and its dump files into the heartbeat directory (see :func:`flight_recorder_env`).
_FR_PIPE, _FR_DUMP = "nccl-pipe-rank-", "nccl-trace-rank-"


def flight_recorder_env(beats: Path, environ: dict[str, str]) -> dict[str, str]:
    """What the ranks need so that a hang can ask NCCL for its last collectives (only
    ProcessGroupNCCL reads these; a user's own settings win)."""
    wanted = {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": str(beats / _FR_PIPE),
              "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(beats / _FR_DUMP)}
    return {k: v for k, v in wanted.items() if k not in environ}


def _ask_flight_recorder(beats_dir: Path, beats: list[Beat]) -> None:
    for b in beats:
        pipe = beats_dir / f"{_FR_PIPE}{b.rank}.pipe"
        if not pipe.exists():
            continue  # not an NCCL job
        try:
            fd = os.open(pipe, os.O_WRONLY | os.O_NONBLOCK)
            os.write(fd, b"1\n")
            os.close(fd)
        except OSError:
            continue
    if any((beats_dir / f"{_FR_PIPE}{b.rank}.pipe").exists() for b in beats):
        time.sleep(5)  # the dump is written by NCCL's watchdog thread


def _copy_flight_recorder(beats_dir: Path, directory: Path, host: str) -> None:
    for dump in beats_dir.glob(f"{_FR_DUMP}*"):
        shutil.copyfile(dump, directory / f"{host}-{dump.name}")


def job_tag(environ: dict[str, str], rdzv_id: str | None) -> str:
    """The same name on every node of one job attempt (the hang directory is shared)."""
    if "SLURM_JOB_ID" in environ:
        return f"slurm{environ['SLURM_JOB_ID']}.{environ.get('SLURM_RESTART_COUNT', '0')}"
    return rdzv_id or time.strftime("%Y%m%d-%H%M%S")


def _beats_root() -> str | None:
    """Node-local memory where it exists (no disk, no shared file system), else the temp dir."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None


@contextmanager
def watching(timeout_s: float, run_dir: Path, *, nnodes: int = 1,
             rdzv_id: str | None = None) -> Iterator[Watchdog | None]:
    """Heartbeats for the ranks started inside (through the environment they inherit) and a
    watchdog over them; nothing when ``timeout_s`` is 0."""
    if timeout_s <= 0:
        yield None
        return
    beats = Path(tempfile.mkdtemp(prefix="hpctrain-beats-", dir=_beats_root()))
    added = {protocol.HEARTBEAT_ENV: str(beats), **flight_recorder_env(beats, dict(os.environ))}
    os.environ.update(added)
    dog = Watchdog(beats, timeout_s, run_dir, job_tag(dict(os.environ), rdzv_id), nnodes=nnodes).start()
    try:
        yield dog
    finally:
        dog.stop()
        for key in added:
            os.environ.pop(key, None)
        shutil.rmtree(beats, ignore_errors=True)
