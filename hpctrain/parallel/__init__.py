"""Apply a parallel strategy to a model, in one documented order:
tensor parallel -> activation checkpointing -> compile -> FSDP / DDP.

- :func:`parallelize` for a built model (ddp, zero1, fsdp, hsdp; tp; deepspeed leaves the
  model to :func:`hpctrain.parallel.deepspeed.init_deepspeed`);
- :func:`build_parallel` builds it too, on the meta device when ``parallel.meta_init``;
- :func:`build_pipeline_step` (``parallel.pp > 1``) cuts the model into stages, applies the
  same order to each, and returns a step function ``step(inputs, targets) -> loss``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from hpctrain.env import ClusterEnv
from hpctrain.errors import UserError
from hpctrain.parallel.checkpointing import apply_activation_checkpointing
from hpctrain.parallel.config import SHARDED, ParallelConfig, Topology, check_topology, resolve_param_dtype
from hpctrain.parallel.ddp import wrap_ddp
from hpctrain.parallel.fsdp import apply_fsdp, shard_units
from hpctrain.parallel.mesh import build_mesh, dp_mesh
from hpctrain.parallel.meta import materialize, on_meta
from hpctrain.parallel.pipeline import LossFn, PipelineStep, build_pipeline
from hpctrain.parallel.tensor import apply_tp


def mesh_for(env: ClusterEnv, cfg: ParallelConfig, device_type: str = "cpu") -> tuple[Topology, DeviceMesh]:
    """The checked topology and its DeviceMesh (``pp``, ``dp`` [or replicate x shard], ``tp``)."""
    topo = check_topology(cfg, env.world_size, num_nodes=env.num_nodes)
    mesh = build_mesh(world=env.world_size, dp=topo.dp, tp=topo.tp, pp=topo.pp, device_type=device_type,
                      dp_replicate=topo.dp_replicate)
    return topo, mesh


def parallelize(model: nn.Module, env: ClusterEnv, cfg: ParallelConfig, *, compile: bool = False,
                precision: str = "fp32", mesh: DeviceMesh | None = None) -> nn.Module:
    """The model ready for training on this rank (moved to its device beforehand, or on meta
    for :func:`build_parallel`). ``mesh``: one from :func:`mesh_for`, else built here."""
    if cfg.pp > 1:
        raise UserError("parallel.pp > 1 runs through a pipeline step function, not a wrapped model; "
                        "hint: use hpctrain.parallel.pipeline.build_pipeline")
    if not env.distributed:
        return _compile(apply_activation_checkpointing(model, mode=cfg.activation_checkpointing), compile, cfg)
    if mesh is None:
        topo, mesh = mesh_for(env, cfg, _device_type(model))
    else:
        topo = check_topology(cfg, env.world_size, num_nodes=env.num_nodes)
    if topo.tp > 1:
        apply_tp(model, mesh=mesh["tp"], sequence_parallel=cfg.sequence_parallel)
    model = _compile(apply_activation_checkpointing(model, mode=cfg.activation_checkpointing), compile, cfg)
    return _data_parallel(model, cfg, topo, mesh, precision)


def _data_parallel(model: nn.Module, cfg: ParallelConfig, topo: Topology, mesh: DeviceMesh,
                   precision: str) -> nn.Module:
    if topo.dp == 1 or cfg.strategy == "deepspeed":
        return model  # nothing to replicate, or DeepSpeed's engine wraps it (init_deepspeed)
    if cfg.strategy in SHARDED:
        return apply_fsdp(model, mesh=dp_mesh(mesh), reshard_after_forward=cfg.reshard_after_forward,
                          param_dtype=resolve_param_dtype(cfg, precision), reduce_dtype=cfg.reduce_dtype,
                          cpu_offload=cfg.cpu_offload)
    return wrap_ddp(model, cfg)  # ddp, and zero1 (whose optimizer is hpctrain.parallel.zero.zero1_from)


def _compile(model: nn.Module, enabled: bool, cfg: ParallelConfig) -> nn.Module:
    if not enabled:
        return model
    if cfg.strategy in SHARDED:
        for unit in shard_units(model):  # per block, in place: FSDP then shards compiled blocks
            unit.compile()
        return model
    return torch.compile(model)  # type: ignore[return-value]


def _device_type(model: nn.Module) -> str:
    param = next(model.parameters(), None)
    if param is None or param.device.type == "meta":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return param.device.type


def build_parallel(factory: Callable[[], nn.Module], env: ClusterEnv, cfg: ParallelConfig, *,
                   device: torch.device, seed: int, compile: bool = False, precision: str = "fp32",
                   mesh: DeviceMesh | None = None) -> nn.Module:
    """``factory()``'s model parallelized, with the weights of ``torch.manual_seed(seed); factory()``
    in one process; with ``parallel.meta_init`` no rank ever holds the full model on ``device``.
    ``mesh``: one from :func:`mesh_for` the caller keeps (e.g. for evaluation's dp group), else built here."""
    if not (cfg.meta_init and env.distributed):
        torch.manual_seed(seed)
        return parallelize(factory().to(device), env, cfg, compile=compile, precision=precision, mesh=mesh)
    model = parallelize(on_meta(factory), env, cfg, compile=compile, precision=precision, mesh=mesh)
    # Offloaded shards live in host memory; FSDP moves each to the device when it is gathered.
    materialize(model, device=torch.device("cpu") if cfg.cpu_offload else device, factory=factory, seed=seed)
    return model


def build_pipeline_step(model: nn.Module, env: ClusterEnv, cfg: ParallelConfig, *, device: torch.device,
                        loss_fn: LossFn, grad_accum: int = 1, precision: str = "fp32",
                        mesh: DeviceMesh | None = None) -> PipelineStep:
    """``parallel.pp > 1``: this rank's stage(s) of ``model`` (tensor parallel, activation
    checkpointing and FSDP over dp applied per stage) behind a step function."""
    if mesh is None:
        topo, mesh = mesh_for(env, cfg, device.type)
    else:
        topo = check_topology(cfg, env.world_size, num_nodes=env.num_nodes)

    def wrap(stage: nn.Module) -> nn.Module:
        if topo.tp > 1:
            apply_tp(stage, mesh=mesh["tp"], sequence_parallel=cfg.sequence_parallel)
        stage = apply_activation_checkpointing(stage, mode=cfg.activation_checkpointing)
        return _data_parallel(stage, cfg, topo, mesh, precision)

    return build_pipeline(model, pp_group=mesh["pp"].get_group(), device=device, schedule=cfg.pp_schedule,
                          microbatches=cfg.microbatches, loss_fn=loss_fn, virtual_stages=cfg.virtual_stages,
                          grad_accum=grad_accum, wrap=wrap)


def is_sharded(model: nn.Module) -> bool:
    """Does this rank hold shards (FSDP, tensor parallel) rather than whole parameters? (FSDP's
    parameters are whole between a forward and its backward: ZeRO-2 after an eval forward.)"""
    from torch.distributed.tensor import DTensor

    from hpctrain.parallel.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules()) or any(
        isinstance(param, DTensor) for param in model.parameters())


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DDP / torch.compile wrappers (for saving and evaluation)."""
    while True:
        inner = getattr(model, "module", None)
        if not isinstance(inner, nn.Module):  # no `or`: bool() of a compiled module calls its len()
            inner = getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner
