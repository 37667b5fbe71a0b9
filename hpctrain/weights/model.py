"""The trained model out of every strategy: RUN_DIR/model.pt written by rank 0 one tensor at a
time (:mod:`hpctrain.weights.export`), gathered from shards, pipeline stages or DeepSpeed's
partitions by the strategy's own source, and the weights' hash every rank reports in the summary."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from hpctrain.env import ClusterEnv
from hpctrain.errors import agree
from hpctrain.weights.export import write_stream

if TYPE_CHECKING:
    from hpctrain.parallel.base import Strategy


def save_model_streamed(strategy: Strategy, path: Path) -> str:
    """RUN_DIR/model.pt, one consolidated file written by rank 0 one tensor at a time: a sharded
    model (FSDP, HSDP, TP) or a pipeline's stages are gathered tensor by tensor, never whole on
    one rank. Returns params_sha256 (hashed from the streamed tensors) on every rank. Every rank
    calls it; a failed write fails every rank."""
    env = strategy.env
    names = strategy.param_names()
    written = agree("writing model.pt", lambda: write_stream(path, strategy.export_source(),
                                                            write=env.is_main, param_names=names))
    return _params_sha256(written.params_sha256 if written is not None else None, env)


def _params_sha256(digest: str | None, env: ClusterEnv) -> str:
    """Rank 0's hash of the streamed weights (rundir.params_sha256's), on every rank."""
    shared = [digest if env.is_main else ""]
    if env.distributed:
        torch.distributed.broadcast_object_list(shared, src=0)
    return str(shared[0])
