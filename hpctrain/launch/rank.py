"""A rank ends when the launcher that started it dies.

torchrun's agent (inside ``hpctrain run``, or ``torchrun`` itself) starts each rank in a
session of its own, so that it alone decides which signals reach the ranks. The price: a
SIGKILL of the launcher's process group (the OOM killer, ``timeout -s KILL``, a container
runtime stopping the launcher) never reaches the ranks, which went on training with parent
1 and committing into the run directory a restart was about to use. Linux's
``PR_SET_PDEATHSIG`` has the kernel send a signal to a process when its parent dies: each
rank asks for SIGKILL. That is safe for the run: checkpoints commit atomically, and the
restart resumes from the last committed one (tests/checkpoint/test_preempt.py).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from collections.abc import Mapping

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
    launcher's watchdog that start-up is under way (hpctrain.telemetry.heartbeat)."""
    from hpctrain.telemetry import heartbeat

    die_with_launcher()
    heartbeat.from_env()
