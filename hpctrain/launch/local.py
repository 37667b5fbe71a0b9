"""``hpctrain run -n N``: N local ranks through PyTorch's own torchrun machinery.

Signals: torch's elastic agent forwards only the signals in ``--signals-to-handle`` to the
ranks (by default TERM, INT, HUP and QUIT); any other signal kills the agent with its
default action. SIGUSR1 (Slurm's usual warning, ``scancel --signal=USR1``) would then end
the launcher at once (exit 138) while the ranks, which torch starts in their own sessions,
never see it and keep training unsupervised. So the launcher asks torch to handle every
preemption signal of the run's config as well (:func:`signals_to_handle`), with a shutdown
timeout long enough for the ranks' agreed save, and installs the same handler for them
before torch does (a signal during the rendezvous must not kill it either).
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import get_args_parser, run

from hpctrain.checkpoint.preempt import OUTCOME_ENV, all_preempted
from hpctrain.errors import EXIT_HUNG, EXIT_PREEMPTED
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
    ``program`` (``[SCRIPT.py, ARGS...]`` or ``[-m, MODULE, ARGS...]``, as torchrun takes them)."""
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
    return args + (program if program is not None else ["-m", "hpctrain", *subcommand])


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

    A handled signal ends here as ``128 + signal`` once every rank has exited; the caller
    turns it into 3 when the ranks committed their preemption save (status.json). With
    ``hang_timeout_s``, a watchdog ends (or restarts) ranks without progress; a job that
    ends failed after it acted exits with :data:`EXIT_HUNG` (hpctrain.launch.watchdog)."""
    argv = torchrun_args(nproc, subcommand, **options)  # type: ignore[arg-type]
    previous = install_early_handlers(signals_to_handle(options.get("signals", ())))  # type: ignore[arg-type]
    nnodes = int(str(options.get("nnodes", "1")).split(":")[-1])
    rdzv_id = options.get("rdzv_id")
    with watching(hang_timeout_s, run_dir or Path.cwd(), nnodes=nnodes,
                  rdzv_id=rdzv_id if isinstance(rdzv_id, str) else None) as dog, _outcomes() as outcomes:
        try:
            code = _run(argv)
        finally:  # torch leaves its handlers installed; put back what the caller had, at once (a
            for sig, handler in previous.items():  # signal while the watchdog stops must not meet torch's)
                signal.signal(sig, handler)
        if code != 0 and all_preempted(outcomes, nproc):  # each rank saved for a preemption and exited 3
            return EXIT_PREEMPTED
    if code != 0 and dog is not None and dog.fired is not None:
        print(f"hpctrain run: {dog.fired.line()}", file=sys.stderr)
        return EXIT_HUNG
    return code


@contextmanager
def _outcomes() -> Iterator[Path]:
    """A private directory where the ranks record a preemption save (hpctrain.checkpoint.preempt)."""
    directory = Path(tempfile.mkdtemp(prefix="hpctrain-outcomes-"))
    os.environ[OUTCOME_ENV] = str(directory)
    try:
        yield directory
    finally:
        os.environ.pop(OUTCOME_ENV, None)
        shutil.rmtree(directory, ignore_errors=True)


def _run(argv: list[str]) -> int:
    try:
        run(get_args_parser().parse_args(argv))
    except SignalException as err:
        print(f"hpctrain run: {err.sigval.name} forwarded to the ranks; all of them have exited", file=sys.stderr)
        return 128 + int(err.sigval)
    except ChildFailedError as err:
        code = rank_exit_code(err)
        print(f"hpctrain run: {err.name} failed (rank exit code {code}); see the rank logs above", file=sys.stderr)
        return code
    return 0


def rank_exit_code(err: ChildFailedError) -> int:
    """The exit code of the rank that failed first. The agent then stops the others with
    SIGTERM (a negative code), so rank 0 may well show -15 while rank 1's 2 (bad input) is
    the cause; a batch script must see the 2, not a generic 1."""
    by_time = sorted(err.failures.values(), key=lambda f: f.timestamp)
    own = [f.exitcode for f in by_time if f.exitcode > 0]
    return own[0] if own else 1
