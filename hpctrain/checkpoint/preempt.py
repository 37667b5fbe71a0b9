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

A preemption signal never ends a process of the run by its default action, whenever it
comes: :func:`keep_signals`, first thing in a rank's (and the launcher's) main, records it
from before torch's import (seconds) to the process's exit. One that came during start-up
is taken over by the trainer's :class:`SignalFlag` and honoured after the first step; one
after the save (Slurm's warning twice, the warning plus an admin's signal) is recorded
and changes nothing: the process still ends with 3. torch is imported lazily here so that
the keeping can start before it.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

from hpctrain.config.checkpoint import CheckpointConfig
from hpctrain.core.env import ClusterEnv, detect
from hpctrain.core.errors import EXIT_PREEMPTED
from hpctrain.core.protocol import (
    RELAY_ENV,
    forwarded_signals,
    named_peer_failure,
    program_signals,
    record_preempted,
)

log = logging.getLogger("hpctrain")
_kept: int | None = None  # the first preemption signal keep_signals recorded and no SignalFlag took over yet


def signal_names(checkpoint: Any) -> list[str]:
    """The preemption signals of a ``checkpoint`` config section: none without checkpoints
    (nothing could be saved; a signal then keeps its default action)."""
    return list(checkpoint.signals) if checkpoint.enabled else []


def start_up_signals(checkpoint: Any) -> list[str]:
    """What a rank keeps from its start: its preemption signals but SIGTERM. torch's agent
    stops the other ranks with SIGTERM when one fails to start; kept, that would leave them
    waiting for the dead one in the rendezvous (until --shutdown-timeout), and a rank that
    has not trained yet loses nothing by ending."""
    return [name for name in signal_names(checkpoint) if name != "SIGTERM"]


def keep_signals(names: Iterable[str]) -> None:
    """For the rest of this process, the preemption signals ``names`` are only recorded
    (never their default action, which would end the process by the signal: 138, 143)."""
    global _kept
    relayed = signal.Signals.__members__.get(os.environ.pop(RELAY_ENV, ""))
    if relayed is not None and _kept is None:
        _kept = relayed
    kept = [getattr(signal, name) for name in names]
    for sig in kept:
        signal.signal(sig, _record)
    # Python's own exit puts back the default action for every signal it handles (a signal then,
    # while torch's atexit hooks run, would still end the process by it); an ignored one stays ignored
    atexit.register(_ignore, kept)


def _ignore(signals: list[int]) -> None:
    for sig in signals:
        signal.signal(sig, signal.SIG_IGN)


def _record(signum: int, frame: FrameType | None) -> None:
    global _kept
    if _kept is None:
        _kept = signum
        os.environ[RELAY_ENV] = signal.Signals(signum).name  # ranks the launcher starts after this inherit it


class Preempted(SystemExit):
    """A preemption signal ended a phase that has nothing to save (the resume read): the
    process ends with :data:`EXIT_PREEMPTED` at once, and the same command run again starts
    that phase over. A ``SystemExit``: no ``except Exception`` on the way swallows it, and a
    user's program ends with 3 without a traceback."""

    def __init__(self, signum: int, phase: str) -> None:
        super().__init__(EXIT_PREEMPTED)
        self.signum, self.phase = signum, phase

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name


class SignalFlag:
    """Installs handlers for the configured signals; each only records that it fired (inside
    :meth:`interrupting`, it also ends the phase)."""

    def __init__(self, names: list[str]) -> None:
        self.signals = [getattr(signal, name) for name in names]
        self.received: int | None = None
        self._previous: dict[int, Any] = {}
        self._phase: str | None = None  # inside interrupting(): the phase a signal ends
        self._count = 0  # signals handled so far (a phase tells its own from earlier ones)

    @property
    def requested(self) -> bool:
        return self.received is not None

    def install(self) -> None:
        """Handle the signals; one that :func:`keep_signals` recorded since the process
        started counts as received (honoured at the first step boundary)."""
        global _kept
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        kept = _kept
        if kept is not None and kept in self.signals and self.received is None:
            self.received, _kept = kept, None
            log.warning("%s arrived during start-up: saving after the first step, then exit %d",
                        signal.Signals(kept).name, EXIT_PREEMPTED)

    def uninstall(self) -> None:
        """Put back what was there: in a rank, keep_signals' recorder (a late signal then
        changes nothing); in a program that called train(), its own handlers."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received, self._count = signum, self._count + 1
        phase, self._phase = self._phase, None  # raised once: not again while it unwinds
        if phase is not None:
            raise Preempted(signum, phase)

    @contextmanager
    def interrupting(self, phase: str, on_preempted: Callable[[Preempted], None] | None = None) -> Iterator[None]:
        """A phase that saves nothing and may block (the resume read: a file system that hangs,
        a FIFO where a file was expected): a preemption signal inside ends it at once with
        :class:`Preempted` (exit 3) instead of waiting for a step boundary that may never come.
        The handler raises in the main thread, also out of a blocking system call. A rank
        blocked in a collective runs the handler only once the collective fails (its peer
        ended): that error, when a signal came during the phase, counts as the preemption too.
        A signal received before the phase keeps its meaning (honoured after the first step).
        ``on_preempted`` runs once, before the exception leaves (status, a log line)."""
        before = self._count
        # handlers run in the main thread: a phase on another thread must not be ended there
        self._phase = phase if threading.current_thread() is threading.main_thread() else None
        try:
            yield
        except BaseException as err:
            if self._count == before or self.received is None:
                raise  # no signal in the phase: the error stands (rank.first_cause may still name a dead peer)
            failed = named_peer_failure(err)  # the signal was the launcher stopping us after a rank's death
            if failed is not None:
                raise failed from err
            ended = err if isinstance(err, Preempted) else Preempted(self.received, phase)
            self._ended(ended, on_preempted)
            if ended is err:
                raise
            raise ended from err
        finally:
            self._phase = None
        if self._count != before and self.received is not None:  # a handler's raise someone swallowed
            ended = Preempted(self.received, phase)
            self._ended(ended, on_preempted)
            raise ended

    def _ended(self, err: Preempted, on_preempted: Callable[[Preempted], None] | None) -> None:
        self._phase = None
        record_preempted()  # under hpctrain run: the launcher then exits 3 for any program
        if on_preempted is not None:
            on_preempted(err)


# Preemption signals a build tool leaves alone (ninja handles INT, TERM and HUP itself, and
# stops the build on them): an ignored one stays ignored in every child, across exec.
SHIELDED = ("SIGUSR1", "SIGUSR2")


@contextmanager
def children_shielded() -> Iterator[None]:
    """Child processes started inside never see SIGUSR1 or SIGUSR2 (DeepSpeed's first use builds
    C++ ops with ``ninja`` in the rank's process group, and ``hpctrain run`` forwards a
    preemption signal to that whole group: by its default action the signal killed ninja half
    way, an internal error and exit 138). Inside, this process ignores them, so its children
    inherit that; on the way out its handlers are back and it delivers to itself each signal
    ``hpctrain run`` forwarded meanwhile (the launcher's note), so the handler decides as if
    it had come now: the trainer's flag saves after the first step and exits 3. Under a plain
    torchrun, which leaves no note, a signal during the build is lost (the build is not).
    Main thread only (handlers can be set nowhere else)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    sigs = [getattr(signal, name) for name in SHIELDED if hasattr(signal, name)]
    before = forwarded_signals()
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in sigs}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        for name in sorted(forwarded_signals() - before):
            if name in SHIELDED:
                signal.raise_signal(getattr(signal, name))


class Agreement:
    """All ranks decide alike at a step boundary: one all-reduce of two ints, MAX.

    One process needs no collective. With several ranks the check runs every
    ``every`` steps (a signal then waits at most that many steps)."""

    def __init__(self, env: ClusterEnv, group: Any, every: int = 1) -> None:
        import torch
        import torch.distributed as dist

        self.distributed, self.group, self.every = env.distributed and dist.is_initialized(), group, every
        self._buf = torch.zeros(2, dtype=torch.int32)
        self._all_reduce, self._max = dist.all_reduce, dist.ReduceOp.MAX

    def __call__(self, step: int, signal_seen: bool, timer_due: bool) -> tuple[bool, bool]:
        if not self.distributed:
            return signal_seen, timer_due
        if step % self.every:
            return False, False
        self._buf[0], self._buf[1] = int(signal_seen), int(timer_due)
        self._all_reduce(self._buf, op=self._max, group=self.group)
        return bool(self._buf[0]), bool(self._buf[1])


class Preemption:
    """"Save, then exit 3" for any loop, in a few lines::

        preemption = Preemption()            # before the loop: the signals only set a flag
        for step in ...:
            ...
            if preemption.agreed(step):      # every rank alike (one tiny all-reduce if distributed)
                save_checkpoint()
                preemption.exit()            # exit 3: hpctrain run / hpctrain slurm requeue

    ``signals``: the names to handle (default: checkpoint.signals' default); ``every``: how
    often (in steps) the ranks agree."""

    def __init__(self, signals: Iterable[str] | None = None, every: int = 1) -> None:
        if signals is None:  # hpctrain slurm --signal's choice, else checkpoint.signals' default
            signals = program_signals(CheckpointConfig().signals)
        self.flag = SignalFlag(list(signals))
        self.flag.install()
        self._every = every
        self._agreement: Agreement | None = None

    def agreed(self, step: int) -> bool:
        """True on every rank at the same step once any rank got a preemption signal."""
        if self._agreement is None:
            self._agreement = Agreement(detect(), None, self._every)
        seen, _ = self._agreement(step, self.flag.requested, False)
        return seen

    def exit(self) -> None:
        """Record the preemption for the launcher and end the process with 3."""
        record_preempted()
        raise SystemExit(EXIT_PREEMPTED)
