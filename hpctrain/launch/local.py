"""``hpctrain run -n N``: N local ranks through PyTorch's own torchrun machinery.

Signals: torch's elastic agent forwards only the signals in ``--signals-to-handle`` to the
ranks (by default TERM, INT, HUP and QUIT); any other signal kills the agent with its
default action. SIGUSR1 (Slurm's usual warning, ``scancel --signal=USR1``) would then end
the launcher at once (exit 138) while the ranks, which torch starts in their own sessions,
never see it and keep training unsupervised. So the launcher asks torch to handle every
preemption signal of the run's config as well (:func:`signals_to_handle`), with a shutdown
timeout long enough for the ranks' agreed save, and installs the same handler for them
before torch does (a signal during the rendezvous must not kill it either). After a forwarded
signal the launcher exits with the ranks' common exit code (3 after their preemption save),
which torch's agent keeps to itself: :class:`RankExits` looks on as it closes its ranks.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing.api import PContext, SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import get_args_parser, run

from hpctrain.core.errors import EXIT_HUNG, EXIT_PREEMPTED
from hpctrain.core.protocol import (
    OUTCOME_ENV,
    all_preempted,
    ending,
    note_ended,
    note_forwarded,
    read_status,
    write_status,
)
from hpctrain.launch import DEFAULT_SHUTDOWN_TIMEOUT_S
from hpctrain.launch.watchdog import watching

# What torch handles by default, plus the usual preemption warnings.
BASE_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
# Newer torchrun options: a cluster's own torch build may predate them (torch 2.11 has no
# --shutdown-timeout), and an unknown option would stop torchrun before any rank starts.
VERSIONED_OPTIONS = ("--signals-to-handle", "--shutdown-timeout")
log = logging.getLogger("hpctrain")


def signals_to_handle(extra: Iterable[str] = ()) -> list[str]:
    """BASE_SIGNALS then the run's ``checkpoint.signals``, each once, in a stable order."""
    names: list[str] = []
    for name in (*BASE_SIGNALS, *extra):
        if name not in names:
            names.append(name)
    return names


def torchrun_args(nproc: int, subcommand: list[str], *, max_restarts: int = 0, nnodes: str = "1",
                  rdzv_endpoint: str | None = None, rdzv_id: str | None = None, node_rank: int | None = None,
                  monitor_interval: float = 0.1, signals: Iterable[str] = (),
                  shutdown_timeout: int = DEFAULT_SHUTDOWN_TIMEOUT_S, program: list[str] | None = None) -> list[str]:
    """The torchrun command line that runs ``python -m hpctrain SUBCOMMAND...`` on each rank, or
    ``program`` (``[SCRIPT.py, ARGS...]`` or ``[-m, MODULE, ARGS...]``, as torchrun takes them)
    through :mod:`hpctrain.launch.rank`, which sets Slurm's variables from torchrun's first."""
    # monitor_interval: how often the agent polls its ranks; 0.5 s added ~0.25 s to the end of every
    # run (and of every test that launches one) for a poll that costs microseconds.
    args = [f"--nproc-per-node={nproc}", f"--nnodes={nnodes}", f"--max-restarts={max_restarts}",
            f"--monitor-interval={monitor_interval}", f"--signals-to-handle={','.join(signals_to_handle(signals))}",
            f"--shutdown-timeout={shutdown_timeout}"]
    args = [a for a in args if a.split("=", 1)[0] not in VERSIONED_OPTIONS or torchrun_accepts(a.split("=", 1)[0])]
    if node_rank is not None:
        args.append(f"--node-rank={node_rank}")
    if rdzv_endpoint:
        args += ["--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}", f"--rdzv-id={rdzv_id or 'hpctrain'}"]
    else:
        args.append("--standalone")  # single node: a free port, no fixed endpoint to collide on
    return args + (["-m", "hpctrain.launch.rank", *program] if program is not None else ["-m", "hpctrain", *subcommand])


@functools.cache
def torchrun_accepts(option: str) -> bool:
    """Does this torch's torchrun know ``option``? Asked of its own parser, not its version."""
    _, unknown = get_args_parser().parse_known_args([f"{option}=1", "script.py"])
    if unknown and option in _FALLBACK:
        log.warning("this torch's torchrun has no %s; %s", option, _FALLBACK[option])
    return not unknown


_FALLBACK = {
    "--shutdown-timeout": "after a signal the ranks get torch's default 30 s to save before they are killed",
    "--signals-to-handle": "only TERM/INT/HUP/QUIT reach the ranks through torch; hpctrain's own handler "
                           "forwards the other preemption signals",
}


def _raise_signal(signum: int, frame: object) -> None:
    # torch's own agent reacts to exactly this exception: it sends the signal to every
    # rank, waits up to --shutdown-timeout for them to exit, then re-raises it.
    raise SignalException(f"hpctrain run received {signal.Signals(signum).name}", sigval=signal.Signals(signum))


def install_early_handlers(names: Iterable[str]) -> dict[signal.Signals, Any]:
    """Cover the window before torch installs its handlers (rendezvous, worker start);
    returns the handlers they replace."""
    return {sig: signal.signal(sig, _raise_signal) for sig in (getattr(signal, name) for name in names)}


def launch(nproc: int, subcommand: list[str], *, hang_timeout_s: float = 0.0, run_dir: Path | None = None,
           **options: object) -> int:
    """Run and wait; returns the exit code (non-zero if any rank failed after all restarts).

    A handled signal ends here, once every rank has exited, with their common exit code (3
    after their preemption save), else ``128 + signal``, which the caller turns into 3 when
    the ranks committed their preemption save (status.json). A failed run whose rank 0 died
    gets its first cause in status.json from here (nobody else could write it). With
    ``hang_timeout_s``, a watchdog ends (or restarts) ranks without progress; a job that
    ends failed after it acted exits with :data:`EXIT_HUNG` (hpctrain.launch.watchdog)."""
    argv, started = torchrun_args(nproc, subcommand, **options), time.time()  # type: ignore[arg-type]
    previous = install_early_handlers(signals_to_handle(options.get("signals", ())))  # type: ignore[arg-type]
    nnodes = int(str(options.get("nnodes", "1")).split(":")[-1])
    rdzv_id = options.get("rdzv_id")
    with watching(hang_timeout_s, run_dir or Path.cwd(), nnodes=nnodes,
                  rdzv_id=rdzv_id if isinstance(rdzv_id, str) else None) as dog, _outcomes() as outcomes, \
            RankExits(outcomes).watching() as exits:
        try:
            code = _run(argv, exits)
        finally:  # torch leaves its handlers installed; put back what the caller had, at once (a
            for sig, handler in previous.items():  # signal while the watchdog stops must not meet torch's)
                signal.signal(sig, handler)
        if code != 0 and all_preempted(outcomes, nproc):  # each rank saved for a preemption and exited 3
            return EXIT_PREEMPTED
    if code != 0 and dog is not None and dog.fired is not None:
        print(f"hpctrain run: {dog.fired.line()}", file=sys.stderr)
        return EXIT_HUNG
    if code not in (0, EXIT_PREEMPTED) and exits.first is not None and run_dir is not None:
        _record_first_cause(run_dir, started, *exits.first)
    return code


def _record_first_cause(run_dir: Path, started: float, rank: int, code: int) -> None:
    """A run whose rank 0 died (SIGKILL, the OOM killer) left status.json "running": nobody else
    writes it. The launcher records the first cause then; a status any rank wrote stays."""
    status = read_status(run_dir)
    if status.get("outcome") == "running" and status.get("time", 0.0) >= started:
        write_status(run_dir, "failed", step=status.get("step"), error=f"rank {rank} ended with {ending(code)}")


@contextmanager
def _outcomes() -> Iterator[Path]:
    """A private directory where the ranks record a preemption save (hpctrain.core.protocol)."""
    directory = Path(tempfile.mkdtemp(prefix="hpctrain-outcomes-"))
    os.environ[OUTCOME_ENV] = str(directory)
    try:
        yield directory
    finally:
        os.environ.pop(OUTCOME_ENV, None)
        shutil.rmtree(directory, ignore_errors=True)


def _run(argv: list[str], exits: RankExits | None = None) -> int:
    try:
        run(get_args_parser().parse_args(argv))
    except SignalException as err:
        codes = set(exits.codes.values()) if exits is not None else set()
        if len(codes) == 1 and min(codes) >= 0:  # every rank ended by itself, alike: that is the answer
            code = codes.pop()
            print(f"hpctrain run: {err.sigval.name} forwarded to the ranks; all of them exited with {code}",
                  file=sys.stderr)
            return code
        print(f"hpctrain run: {err.sigval.name} forwarded to the ranks; all of them have exited", file=sys.stderr)
        return 128 + int(err.sigval)
    except ChildFailedError as err:
        code = rank_exit_code(err)
        first = first_failure(err)
        cause = f"rank {first[0]} ended with {ending(first[1])} first; " if first is not None else ""
        print(f"hpctrain run: {err.name} failed: {cause}exit code {code}; see the rank logs above", file=sys.stderr)
        return code
    return 0


def first_failure(err: ChildFailedError) -> tuple[int, int] | None:
    """(rank, exit code) of the rank that ended first (a negative code: the signal)."""
    by_time = sorted(err.failures.items(), key=lambda item: item[1].timestamp)
    return (by_time[0][0], by_time[0][1].exitcode) if by_time else None


class RankExits:
    """How the ranks ended, as torch's agent sees it but does not tell: it closes its process
    context (``PContext.close``) the moment one rank fails (stopping the others) and when a
    forwarded signal ends the run (waiting for the ranks' own exit). Around each close this
    notes, in the ranks' outcome directory, every rank already ended with a failure, before the
    others are stopped, so they can name the first cause (:func:`hpctrain.launch.rank.first_cause`);
    and it keeps every rank's exit code after the close (``codes``: rank -> code, negative: a
    signal). Reads only the contexts' process handles; a torch without them leaves both empty."""

    def __init__(self, notes: Path) -> None:
        self.notes = notes
        self.codes: dict[int, int] = {}
        self.first: tuple[int, int] | None = None  # (rank, code) of the first failure noted

    @contextmanager
    def watching(self) -> Iterator[RankExits]:
        original = PContext.close

        def close(context: PContext, death_sig: signal.Signals | None = None, timeout: int = 30) -> None:
            self._note_failed(context)
            if death_sig is not None:  # a forwarded signal (a rank's failure stops the others with the default)
                self._note_forwarded(context, death_sig)
            try:
                original(context, death_sig, timeout)
            finally:
                self.codes = {rank: code for rank, code, _ in self._ended(context)}

        PContext.close = close  # type: ignore[method-assign,assignment]
        try:
            yield self
        finally:
            PContext.close = original  # type: ignore[method-assign]

    def _note_failed(self, context: PContext) -> None:
        failed = [(rank, code, restart) for rank, code, restart in self._ended(context) if code != 0]
        for rank, code, restart in failed:
            note_ended(self.notes, restart, rank, code)
        causes = [(rank, code) for rank, code, _ in failed if code != EXIT_PREEMPTED]
        if causes and self.first is None:  # a death by a signal before an exit: the others followed it
            self.first = min(causes, key=lambda item: (item[1] >= 0, item[0]))

    def _note_forwarded(self, context: PContext, death_sig: signal.Signals) -> None:
        envs: dict[int, dict[str, str]] = getattr(context, "envs", {}) or {}
        restarts = {env.get("TORCHELASTIC_RESTART_COUNT", "0") for env in envs.values()} or {"0"}
        for restart in restarts:
            note_forwarded(self.notes, restart, signal.Signals(death_sig).name)

    @staticmethod
    def _ended(context: PContext) -> Iterator[tuple[int, int, str]]:
        """(global rank, exit code, restart count) of each rank of ``context`` that has ended."""
        envs: dict[int, dict[str, str]] = getattr(context, "envs", {}) or {}
        for local_rank, handler in (getattr(context, "subprocess_handlers", None) or {}).items():
            proc = getattr(handler, "proc", None)
            code = proc.poll() if proc is not None else None
            if code is None:
                continue
            env = envs.get(local_rank, {})
            rank = int(env.get("RANK", local_rank))
            yield rank, code, env.get("TORCHELASTIC_RESTART_COUNT", "0")


def rank_exit_code(err: ChildFailedError) -> int:
    """The exit code of the rank that failed first. The agent then stops the others with
    SIGTERM (a negative code), so rank 0 may well show -15 while rank 1's 2 (bad input) is
    the cause; a batch script must see the 2, not a generic 1."""
    by_time = sorted(err.failures.values(), key=lambda f: f.timestamp)
    own = [f.exitcode for f in by_time if f.exitcode > 0]
    return own[0] if own else 1
