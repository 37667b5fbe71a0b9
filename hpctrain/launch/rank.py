"""A rank's life under ``hpctrain run``: it ends with its launcher, it sees the launcher's
world in Slurm's variables too, and when another rank dies first it says so.

**It ends when the launcher that started it dies.**

torchrun's agent (inside ``hpctrain run``, or ``torchrun`` itself) starts each rank in a
session of its own, so that it alone decides which signals reach the ranks. The price: a
SIGKILL of the launcher's process group (the OOM killer, ``timeout -s KILL``, a container
runtime stopping the launcher) never reaches the ranks, which went on training with parent
1 and committing into the run directory a restart was about to use. Linux's
``PR_SET_PDEATHSIG`` has the kernel send a signal to a process when its parent dies: each
rank asks for SIGKILL. That is safe for the run: checkpoints commit atomically, and the
restart resumes from the last committed one (tests/checkpoint/test_preempt.py).

**Slurm's variables describe torchrun's world.** A library that reads Slurm's variables
(Lightning's ``SLURMEnvironment``, submitit) would see srun's task (one per node, so
``SLURM_NTASKS`` = nodes, not ranks) inside an ``hpctrain slurm`` step, and nothing at all on
a laptop (``KeyError: 'SLURM_NODEID'``). A user's program therefore starts through
:func:`main` (``python -m hpctrain.launch.rank SCRIPT.py ARGS``), which sets them from
torchrun's and then replaces itself with the program, as torchrun would have started it.

**The first cause is the one reported.** When a rank dies (SIGKILL, the OOM killer), the
others fail in their next collective with an error that names nothing ("Connection closed by
peer"). The launcher notes each rank it saw end with a failure before it stops the others
(:func:`hpctrain.core.protocol.note_ended`); :func:`first_cause` turns the others' secondary error into one naming
that rank ("rank 1 ended with signal 9 (SIGKILL)").
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import time
from collections.abc import Iterator, Mapping, MutableMapping
from contextlib import contextmanager

from hpctrain.core import protocol
from hpctrain.core.errors import HpctrainError, RunError
from hpctrain.core.protocol import OUTCOME_ENV, named_peer_failure, one_line

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def under_torchrun(environ: Mapping[str, str]) -> bool:
    """Started by torchrun's agent (it sets TORCHELASTIC_RUN_ID for its workers)."""
    return "TORCHELASTIC_RUN_ID" in environ


def die_with_launcher(environ: Mapping[str, str] | None = None) -> bool:
    """Under torchrun on Linux: ask the kernel to SIGKILL this process when its parent (the
    agent) dies, and exit now if it already has. Returns whether the request is in place."""
    environ = os.environ if environ is None else environ
    if not under_torchrun(environ) or not sys.platform.startswith("linux"):
        return False
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        failed = libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0
    except (OSError, AttributeError):  # no prctl in this libc
        failed = True
    if failed:
        log.warning("could not ask to end with the launcher (prctl PR_SET_PDEATHSIG); if the launcher is killed, "
                    "end this rank (pid %d) by hand", os.getpid())
        return False
    if parent == 1 or os.getppid() != parent:  # the agent died before the request: nobody would see this rank
        os._exit(128 + int(signal.SIGKILL))
    return True


def start_rank() -> None:
    """First thing in a rank's ``train`` / ``eval``: end with the launcher, and show the
    launcher's watchdog that start-up is under way (its heartbeat, hpctrain.core.protocol)."""
    die_with_launcher()
    protocol.from_env()


# ---------------------------------------------------------------- Slurm's variables

# Slurm's name -> torchrun's, for each rank: what srun would have set had it started the ranks.
_SLURM_FROM_TORCHRUN = {"SLURM_PROCID": "RANK", "SLURM_LOCALID": "LOCAL_RANK", "SLURM_NTASKS": "WORLD_SIZE",
                        "SLURM_NODEID": "GROUP_RANK", "SLURM_NTASKS_PER_NODE": "LOCAL_WORLD_SIZE"}


def slurm_view(environ: Mapping[str, str]) -> dict[str, str]:
    """Slurm's per-task variables as srun would set them for torchrun's ranks (``{}`` outside
    torchrun), and ``SLURM_NNODES`` as the nodes torchrun's world spans."""
    if not under_torchrun(environ) or "RANK" not in environ:
        return {}
    view = {slurm: environ[torch] for slurm, torch in _SLURM_FROM_TORCHRUN.items() if torch in environ}
    world, local = int(environ.get("WORLD_SIZE", "1")), int(environ.get("LOCAL_WORLD_SIZE", "1"))
    view["SLURM_NNODES"] = str(max(1, world // max(1, local)))
    return view


def main(argv: list[str] | None = None, environ: MutableMapping[str, str] | None = None) -> None:
    """``python -m hpctrain.launch.rank PROGRAM...``: Slurm's variables from torchrun's, then
    ``python -u PROGRAM...`` in this process's place (same pid: torch's agent still watches it).
    PROGRAM is ``SCRIPT.py ARGS`` or ``-m MODULE ARGS``."""
    args = sys.argv[1:] if argv is None else argv
    env = os.environ if environ is None else environ
    env.update(slurm_view(env))
    sys.stdout.flush()
    os.execv(sys.executable, [sys.executable, "-u", *args])


# ---------------------------------------------------------------- the first cause


def peer_failure(err: BaseException, wait_s: float = 5.0, environ: Mapping[str, str] | None = None) -> RunError | None:
    """The error to report instead of ``err`` when another rank ended first: it names that rank.
    A communication error waits up to ``wait_s`` for the launcher's note (it polls its ranks
    every 0.1 s); without one it still says what it is, not "a bug". None: ``err`` stands."""
    lost = _looks_like_a_lost_peer(err)
    noted = bool((os.environ if environ is None else environ).get(OUTCOME_ENV))  # else no note can come
    deadline = time.monotonic() + (wait_s if lost and noted else 0.0)
    # an error of its own (not a lost peer) is only put down to a rank killed by a signal: a rank
    # that exited by itself first may well have hit the same error
    while (named := named_peer_failure(err, environ, killed_only=not lost)) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if named is None and lost:
        return RunError(f"a collective failed because another rank or the network went away ({one_line(err)}); "
                        "hint: the launcher's log names the rank that ended first")
    return named


def _looks_like_a_lost_peer(err: BaseException) -> bool:
    dist = sys.modules.get("torch.distributed")
    if dist is not None and isinstance(err, getattr(dist, "DistError", ())):
        return True
    text = str(err)
    return isinstance(err, RuntimeError) and any(
        mark in text for mark in ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                                  "NCCL communicator was aborted", "Socket Timeout", "recvBytes"))


@contextmanager
def first_cause(environ: Mapping[str, str] | None = None) -> Iterator[None]:
    """Around a rank's work: an error that followed another rank's death (see :func:`peer_failure`)
    leaves as a :class:`~hpctrain.core.errors.RunError` naming that rank; hpctrain's own errors and
    everything else go on unchanged."""
    try:
        yield
    except Exception as err:
        if isinstance(err, HpctrainError):
            raise
        replaced = peer_failure(err, environ=environ)
        if replaced is None:
            raise
        raise replaced from err


if __name__ == "__main__":
    main()
