"""The trained model out of every strategy: RUN_DIR/model.pt written by rank 0 one tensor at a
time (hpctrain.checkpoint.export), gathered from shards, pipeline stages or DeepSpeed's
partitions, and the weights' hash every rank reports in the summary."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hpctrain import env as cluster
from hpctrain.checkpoint.export import Source, dict_source, model_source, pipeline_source, write_stream
from hpctrain.config import Config
from hpctrain.errors import agree
from hpctrain.parallel import unwrap
from hpctrain.parallel.deepspeed import DeepSpeedStep
from hpctrain.parallel.pipeline import PipelineStep
from hpctrain.rundir import param_names
from hpctrain.strategy import data_env

if TYPE_CHECKING:  # hpctrain.train imports this module
    from hpctrain.train import Components


def save_model_streamed(cfg: Config, env: cluster.ClusterEnv, parts: Components, path: Path) -> str:
    """RUN_DIR/model.pt, one consolidated file written by rank 0 one tensor at a time: a sharded
    model (FSDP, HSDP, TP) or a pipeline's stages are gathered tensor by tensor, never whole on
    one rank (hpctrain.checkpoint.export). Returns params_sha256 (hashed from the streamed
    tensors) on every rank. Every rank calls it; a failed write fails every rank."""
    # the names: a pipeline's or DeepSpeed's whole model is on meta (no `or` on modules: bool() calls len())
    whole = parts.flops_model if parts.step is not None and parts.flops_model is not None else unwrap(parts.model)
    names = param_names(whole)
    written = agree("writing model.pt", lambda: write_stream(path, full_state(cfg, env, parts),
                                                            write=env.is_main, param_names=names))
    return _params_sha256(written.params_sha256 if written is not None else None, env)


def full_state(cfg: Config, env: cluster.ClusterEnv, parts: Components) -> Source:
    """The whole model's tensors, to be streamed (every rank calls it and consumes them)."""
    if isinstance(parts.step, PipelineStep):
        step = parts.step
        return pipeline_source({step.global_name(k): v for k, v in step.model.state_dict().items()},
                               # one rank of each stage owns its names: replica 0's tp rank 0
                               sender=data_env(cfg, env).rank == 0 and env.rank % cfg.parallel.tp == 0, rank=env.rank,
                               device=cluster.collective_device())
    if isinstance(parts.step, DeepSpeedStep):  # ZeRO-3: DeepSpeed's own gather (to rank 0)
        return dict_source(deepspeed_full_state(parts.model, env) if env.is_main or _zero3(parts.model) else {})
    return model_source(parts.model, is_main=env.is_main)


def _zero3(engine: Any) -> bool:
    return bool(engine.zero_optimization_stage() == 3)


def deepspeed_full_state(engine: Any, env: cluster.ClusterEnv) -> dict[str, torch.Tensor]:
    """The whole model's state on rank 0's CPU: ZeRO-3 gathers its partitioned parameters (every
    rank calls it); ZeRO-1/2 keep whole parameters on every rank."""
    if engine.zero_optimization_stage() == 3:
        state = engine._zero3_consolidated_16bit_state_dict()  # DeepSpeed's own gather, to rank 0
        return {k: v.detach().cpu() for k, v in state.items()} if env.is_main and state else {}
    return {k: v.detach().cpu() for k, v in engine.module.state_dict().items()}


def _params_sha256(digest: str | None, env: cluster.ClusterEnv) -> str:
    """Rank 0's hash of the streamed weights (rundir.params_sha256's), on every rank."""
    shared = [digest if env.is_main else ""]
    if env.distributed:
        torch.distributed.broadcast_object_list(shared, src=0)
    return str(shared[0])
