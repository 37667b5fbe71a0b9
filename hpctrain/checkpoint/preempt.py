"""Preemption: signal -> flag -> agreed at a step boundary -> save together -> exit.

A signal handler only sets a flag (no I/O, no collective: either could deadlock or run
while the interrupted code holds a lock). At the next step boundary the ranks agree
with one small all-reduce (MAX of [signal seen, wall-clock save due]) on a dedicated
gloo group, so it never syncs a GPU stream. The outcome goes to ``RUN_DIR/status.json``
and the exit code, so a batch script can requeue only a preempted run:

* exit 0, ``{"outcome": "finished"}``: training is complete;
* exit 3 (:data:`EXIT_PREEMPTED`), ``{"outcome": "preempted"}``: a checkpoint was
  committed; run the same command again (resume=auto continues);
* any other exit, ``{"outcome": "failed"}`` or ``"running"`` (killed): an error or a crash.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from hpctrain.env import ClusterEnv
from hpctrain.errors import EXIT_PREEMPTED

STATUS = "status.json"


class SignalFlag:
    """Installs handlers for the configured signals; each only records that it fired."""

    def __init__(self, names: list[str]) -> None:
        self.signals = [getattr(signal, name) for name in names]
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.received is not None

    def install(self) -> None:
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum


class Agreement:
    """All ranks decide alike at a step boundary: one all-reduce of two ints, MAX.

    One process needs no collective. With several ranks the check runs every
    ``every`` steps (a signal then waits at most that many steps)."""

    def __init__(self, env: ClusterEnv, group: Any, every: int = 1) -> None:
        self.distributed, self.group, self.every = env.distributed and dist.is_initialized(), group, every
        self._buf = torch.zeros(2, dtype=torch.int32)

    def __call__(self, step: int, signal_seen: bool, timer_due: bool) -> tuple[bool, bool]:
        if not self.distributed:
            return signal_seen, timer_due
        if step % self.every:
            return False, False
        self._buf[0], self._buf[1] = int(signal_seen), int(timer_due)
        dist.all_reduce(self._buf, op=dist.ReduceOp.MAX, group=self.group)
        return bool(self._buf[0]), bool(self._buf[1])


# ---------------------------------------------------------------- outcome


def write_status(run_dir: Path, outcome: str, **extra: Any) -> None:
    from hpctrain.rundir import write_json

    write_json(Path(run_dir) / STATUS, {"outcome": outcome, "time": time.time(), **extra})


def read_status(run_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((Path(run_dir) / STATUS).read_text())
    except (OSError, ValueError):
        return {}


def exit_code(outcome: str | None) -> int:
    return EXIT_PREEMPTED if outcome == "preempted" else 0


def launcher_exit_code(cfg: Any, code: int, since: float) -> int:
    """``hpctrain run``: torchrun reports a worker's exit 3 (or its own SIGTERM) as a
    failure; the run directory's status file, written after ``since``, tells a
    preemption apart from a crash."""
    from hpctrain.rundir import resolve_run_dir

    status = read_status(resolve_run_dir(cfg.run.dir, cfg))
    if status.get("outcome") == "preempted" and status.get("time", 0.0) >= since:
        return EXIT_PREEMPTED
    return code
