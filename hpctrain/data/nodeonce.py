"""Work done once per node by local rank 0 while the node's other ranks wait (staging, indexing).

The waiting ranks poll for the work's result (``ready()``), and for a failure marker that
local rank 0 writes when the work raises, so they fail within a second with the same
message instead of waiting out the timeout. The marker lives in the node's temporary
directory (local ranks share it; the work's own directory may be what could not be
created) and is named by a token every rank of this job knows: a nonce broadcast from
rank 0 when a process group exists (staging and indexing run after
``init_process_group``), otherwise the launcher's job ids from the environment. After the
local phase all ranks agree (:func:`hpctrain.core.errors.agree`), so a failure on one node
stops every node.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from hpctrain.core.env import ClusterEnv
from hpctrain.core.errors import EXIT_RUN_FAILED, HpctrainError, PeerError, RunError, agree
from hpctrain.core.safe_open import read_regular

POLL_S = 0.2
MARKER_BYTES = 1 << 20  # a failure's message and exit code: far below this
_JOB_VARS = ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "SLURM_JOB_ID", "SLURM_STEP_ID",
             "SLURM_RESTART_COUNT", "MASTER_ADDR", "MASTER_PORT")


class NodeWaitTimeout(RunError):
    """Local rank 0 did not finish (nor report a failure) within the timeout."""


def _grouped() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def job_token(phase: str) -> str:
    """The same string on every rank of this job and phase, different for the next job."""
    if _grouped():
        box = [uuid.uuid4().hex if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)
        nonce = str(box[0])
    else:
        nonce = "|".join(os.environ.get(v, "") for v in _JOB_VARS)
    return hashlib.sha256(f"{phase}|{nonce}".encode()).hexdigest()[:16]


def failure_marker(token: str) -> Path:
    return Path(tempfile.gettempdir()) / f"hpctrain-{os.getuid()}-failed-{token}.json"


def _report(token: str, err: BaseException) -> None:
    code = err.exit_code if isinstance(err, HpctrainError) else EXIT_RUN_FAILED
    message = str(err) if isinstance(err, HpctrainError) else f"{type(err).__name__}: {err}"
    marker = failure_marker(token)
    tmp = marker.with_name(f".{marker.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps({"message": message, "exit_code": code}))
        os.replace(tmp, marker)  # whole or absent: a waiter never reads half a message
    except OSError:
        pass  # the waiters then time out; the error itself is raised on local rank 0 regardless


def _wait(phase: str, token: str, ready: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    marker = failure_marker(token)
    while not ready():
        if marker.is_file():
            raise _peer_failure(marker)
        if time.monotonic() > deadline:
            raise NodeWaitTimeout(f"waited {timeout_s:.0f} s for local rank 0 to finish {phase}; "
                                  "hint: look at local rank 0's log")
        time.sleep(POLL_S)


def _peer_failure(marker: Path) -> PeerError:
    """Local rank 0's failure as its marker tells it. The marker lies in a shared temporary directory:
    read bounded and regular-file-only, and anything but local rank 0's record is still a failure,
    said as such, never a wait on a FIFO or a traceback."""
    try:
        failed = json.loads(read_regular(marker, limit=MARKER_BYTES))
        return PeerError(str(failed["message"]), exit_code=int(failed["exit_code"]))
    except (OSError, ValueError, KeyError, TypeError, RecursionError):  # UnsafeFileError is a ValueError
        return PeerError(f"local rank 0 failed, and its failure marker {marker} cannot be read; hint: look at local "
                         "rank 0's log", exit_code=EXIT_RUN_FAILED)


def once_per_node(phase: str, env: ClusterEnv, work: Callable[[], None], ready: Callable[[], bool],
                  timeout_s: float = 3600.0) -> None:
    """Local rank 0 runs ``work``; the node's other ranks wait until ``ready()`` or its failure.

    Every rank raises if any rank failed (the same message on the ranks that waited).
    """
    token = job_token(phase)

    def local() -> None:
        if env.local_rank == 0:
            try:
                work()
            except BaseException as err:
                _report(token, err)
                raise
        else:
            _wait(phase, token, ready, timeout_s)

    try:
        agree(phase, local)
    finally:
        if env.local_rank == 0 and _grouped():  # after agree's collective every waiter has read it
            failure_marker(token).unlink(missing_ok=True)
