"""What ``hpctrain train`` runs under each parallel strategy, decided before the process group:
the checks that fail every rank alike with exit 2 (numbers and a hint in the message), the
data's view of the (pp, dp, tp) mesh, the mesh itself, and the checkpoint format sharded state
needs."""

from __future__ import annotations

import logging
from dataclasses import replace

import torch
from torch.distributed.device_mesh import DeviceMesh

from hpctrain import env as cluster
from hpctrain.config import Config, ConfigError
from hpctrain.models import build_model
from hpctrain.parallel import mesh_for
from hpctrain.parallel.config import SHARDED, check_topology
from hpctrain.parallel.deepspeed import import_deepspeed
from hpctrain.parallel.meta import on_meta
from hpctrain.parallel.tensor import check_tp_model

log = logging.getLogger("hpctrain")


def model_mesh(cfg: Config, env: cluster.ClusterEnv, device: torch.device) -> DeviceMesh | None:
    """The (pp, dp, tp) mesh to parallelize over and to evaluate on, built once per run when the
    model is split over ranks (tp or pp > 1); None otherwise (data parallel builds what it needs)."""
    if not env.distributed or (cfg.parallel.tp == 1 and cfg.parallel.pp == 1):
        return None
    return mesh_for(env, cfg.parallel, device.type)[1]


def data_env(cfg: Config, env: cluster.ClusterEnv) -> cluster.ClusterEnv:
    """The world as the data (and the evaluation) sees it: one rank per data-parallel replica.

    The mesh lays the ranks out as (pp, dp, tp), tp innermost (hpctrain/parallel/mesh.py), so
    the tp ranks and the pipeline stages of one replica read the same batches: ``rank`` is this
    rank's dp coordinate ``(rank // tp) % dp`` and ``world_size`` is dp. The node fields stay the
    process's own: staging and indexing (hpctrain.data.nodeonce) must still run once per node,
    by its local rank 0, not once per replica."""
    p = cfg.parallel
    if p.tp == 1 and p.pp == 1:
        return env
    dp = check_topology(p, env.world_size, num_nodes=env.num_nodes).dp  # a world that is not dp x tp x pp: exit 2
    return replace(env, rank=(env.rank // p.tp) % dp, world_size=dp)


def check_strategy(cfg: Config, env: cluster.ClusterEnv) -> None:
    """What ``hpctrain train`` runs today: ddp, zero1, fsdp, hsdp, deepspeed, tensor parallel
    (over dp with fsdp/hsdp) and pipeline stages (each with the limits its check names)."""
    p = cfg.parallel
    if p.tp > 1:
        _check_tensor_parallel(cfg, env)
    if p.strategy == "deepspeed":
        _check_deepspeed_loop(cfg)
    if p.pp > 1:
        _check_pipeline_loop(cfg, env)
    if p.strategy == "zero1" and cfg.checkpoint.enabled and cfg.checkpoint.format == "dcp" and env.distributed:
        raise ConfigError("parallel.strategy=zero1 checkpoints with checkpoint.format=torch (rank 0 writes the "
                          "optimizer state consolidated from every rank), not dcp; hint: checkpoint.format=torch")


def _check_tensor_parallel(cfg: Config, env: cluster.ClusterEnv) -> None:
    """parallel.tp > 1 splits the q/k/v/o/up/down Linears of the model's ``blocks`` (the gpt's):
    any other model, or widths tp does not divide, fails here, before the process group. The
    model is built on meta (no memory); the world must be dp x tp x pp."""
    p, name = cfg.parallel, cfg.model.name
    topo = check_topology(p, env.world_size, num_nodes=env.num_nodes)
    if cfg.precision == "fp16" and (topo.dp == 1 or p.strategy not in SHARDED):
        # without FSDP over dp the embedding, norms and head stay plain tensors beside the DTensor
        # blocks, and the fp16 scaler's unscale cannot take both in one call
        raise ConfigError(f"precision=fp16 with parallel.tp={p.tp} needs data parallelism under "
                          f"parallel.strategy=fsdp or hsdp (got dp={topo.dp}, strategy={p.strategy}); hint: "
                          "precision=bf16 (no loss scaling needed), or more ranks with parallel.strategy=fsdp")
    if cfg.train.compile and p.activation_checkpointing != "none":
        # torch 2.13's compiled activation checkpointing saves the DTensors' DeviceMesh for its
        # version check and fails in the first backward (found running tp2 + block + compile)
        raise ConfigError(f"parallel.tp={p.tp} with train.compile=true and parallel.activation_checkpointing="
                          f"{p.activation_checkpointing} fails inside torch.compile (DTensor in a checkpointed "
                          "region); hint: parallel.activation_checkpointing=none, or train.compile=false")
    model = on_meta(lambda: build_model(name, cfg.model.num_classes or None, config=cfg.model))
    try:
        check_tp_model(model, p.tp)
    except ValueError as err:
        raise ConfigError(f"parallel.tp={p.tp} cannot split model.name={name}: {err}; hint: tensor parallelism "
                          "runs on the gpt (or a model with such `blocks`, see docs/parallel.md); for other models "
                          "use parallel.tp=1 with parallel.strategy=fsdp") from err


def _check_deepspeed_loop(cfg: Config) -> None:
    """strategy=deepspeed needs DeepSpeed importable; it then runs the lr schedule (handed to the
    engine) and checkpoints (DeepSpeed's files inside hpctrain's committed directory; synchronous,
    since DeepSpeed's save runs collectives on the training process group)."""
    import_deepspeed()  # DeepSpeedMissing (a UserError) with the install hint, before the process group


def _check_pipeline_loop(cfg: Config, env: cluster.ClusterEnv) -> None:
    """What the loop runs under parallel.pp > 1: pipeline stages, tensor parallel inside them, x
    data-parallel replicas (strategy fsdp/hsdp over dp), fp32/bf16/fp16, validation, DCP checkpoints."""
    p = cfg.parallel
    check_topology(p, env.world_size, num_nodes=env.num_nodes)  # world = dp x tp x pp, numbers in the message
    if cfg.train.compile or p.meta_init:
        raise ConfigError(f"parallel.pp={p.pp} builds its stages without train.compile or parallel.meta_init yet; "
                          "hint: train.compile=false parallel.meta_init=false")
    if cfg.model.tie_weights and cfg.model.name == "gpt":
        raise ConfigError(f"parallel.pp={p.pp}: the first and last stages cannot share the tied embedding; "
                          "hint: model.tie_weights=false")


def sharded_checkpoints(cfg: Config) -> Config:
    """Sharded strategies (fsdp, hsdp, tensor and pipeline parallel) checkpoint with DCP: each rank writes its
    shards, and a resume at another world size reshards them. checkpoint.format=torch (rank 0
    writes whole state) cannot hold them, so it is switched, said once in the log."""
    p = cfg.parallel
    if cfg.checkpoint.format == "dcp" or not cfg.checkpoint.enabled or (
            p.strategy not in SHARDED and p.tp == 1 and p.pp == 1):
        return cfg
    log.info("parallel.strategy=%s%s%s: checkpoint.format=dcp (sharded state)", p.strategy,
             f", tp={p.tp}" if p.tp > 1 else "", f", pp={p.pp}" if p.pp > 1 else "")
    return replace(cfg, checkpoint=replace(cfg.checkpoint, format="dcp"))

