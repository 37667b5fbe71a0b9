"""One plan per run, computed once from the config and the cluster environment before anything
is built: the mesh ``(pp, dp_replicate, dp_shard, tp)``, this rank's place in data parallelism,
the batch split, the checkpoint format and the FLOPs divisor. Data, parallel, telemetry and
checkpointing read it; nothing derives these values again or patches them afterwards.

Pure arithmetic (no torch): a login node can print a plan without importing torch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from hpctrain.config.parallel import AUTO, check_topology
from hpctrain.core.section import ConfigError
from hpctrain.parallel.registry import strategy_class

if TYPE_CHECKING:  # the composed config imports hpctrain.config.parallel only
    from hpctrain.config import Config
    from hpctrain.config.parallel import ParallelConfig
    from hpctrain.core.env import ClusterEnv

log = logging.getLogger("hpctrain")


@dataclass(frozen=True)
class Plan:
    """How this world runs the job. ``dp`` replicas each read their own batches; the tp ranks
    and pipeline stages of one replica share its batches (the mesh lays ranks out as
    (pp, dp, tp), tp innermost)."""

    strategy: str          # the registered strategy (hpctrain.parallel.registry)
    world_size: int
    rank: int
    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int
    micro_batch: int       # samples per rank per micro-step
    grad_accum: int        # micro-steps per optimizer step
    checkpoint_format: str  # torch (rank 0 writes whole state) | dcp (every rank its shards) | deepspeed

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel replica: its coordinate on the ``dp`` dim of the mesh."""
        return (self.rank // self.tp) % self.dp

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step over the whole job (every replica, every micro-step)."""
        return self.micro_batch * self.grad_accum * self.dp

    @property
    def flops_divisor(self) -> int:
        """One rank runs one stage and 1/tp of each block's matmuls: ~1/(pp x tp) of its replica's FLOPs."""
        return self.pp * self.tp

    @property
    def model_split(self) -> bool:
        """Is the model cut over ranks (tensor or pipeline parallel), so that a mesh is needed?"""
        return self.tp > 1 or self.pp > 1

    def data_env(self, env: ClusterEnv) -> ClusterEnv:
        """The world as the data and the evaluation see it: one rank per data-parallel replica.
        The node fields stay the process's own: staging and indexing still run once per node."""
        if self.dp == env.world_size:
            return env
        return replace(env, rank=self.dp_rank, world_size=self.dp)


def make_plan(cfg: Config, env: ClusterEnv) -> tuple[Config, Plan]:
    """The config as this world runs it (``data.global_batch_size`` resolved to the micro-batch
    and accumulation, the checkpoint format a sharded strategy needs) and the run's plan.
    Checks that need the world size fail here, every rank alike, before any process group.
    ``parallel.strategy=auto`` must be resolved before (:func:`hpctrain.parallel.auto.resolve_auto`:
    the model measured on the meta device, the same choice on every rank; the trainer does it)."""
    from hpctrain.config import check_world, for_world

    p = cfg.parallel
    if p.strategy == AUTO:
        raise ConfigError("parallel.strategy=auto is chosen before the plan; hint: cfg = "
                          "hpctrain.parallel.auto.resolve_auto(cfg, env), then make_plan(cfg, env)")
    topo = check_topology(p, env.world_size, num_nodes=env.num_nodes)  # a world that is not dp x tp x pp: exit 2
    check_world(cfg, topo.dp)  # the global batch is split over the dp replicas only
    cfg = for_world(cfg, topo.dp)
    name = strategy_name(cfg)
    kind = strategy_class(name)
    fmt = kind.checkpoint_format(p)
    if cfg.checkpoint.enabled and fmt == "dcp" and cfg.checkpoint.format != "dcp":
        log.info("parallel.strategy=%s%s%s: checkpoint.format=dcp (sharded state)", p.strategy,
                 f", tp={p.tp}" if p.tp > 1 else "", f", pp={p.pp}" if p.pp > 1 else "")
        cfg = replace(cfg, checkpoint=replace(cfg.checkpoint, format="dcp"))
    plan = Plan(strategy=name, world_size=env.world_size, rank=env.rank, pp=topo.pp,
                dp_replicate=topo.dp_replicate, dp_shard=topo.dp_shard, tp=topo.tp,
                micro_batch=cfg.data.batch_size, grad_accum=cfg.train.grad_accum,
                checkpoint_format=fmt if fmt != "torch" else cfg.checkpoint.format)
    check_model_plan(cfg, plan)
    kind.check(cfg, plan)
    return cfg, plan


def check_model_plan(cfg: Config, plan: Plan) -> None:
    """Tensor and pipeline parallelism cut a model by a plan for its layout: transformer blocks
    as ``blocks`` (an ``nn.ModuleList``), as the built-in gpt has. A user's model without them
    (a Hugging Face model, a CNN) is refused here, exit 2, before any process group: it is built
    on meta (no memory; placeholder sizes, only its layout is read)."""
    if not (plan.model_split and ":" in cfg.model.name):
        return
    from torch import nn

    from hpctrain.models import build_model
    from hpctrain.models.user import CAUSAL_LM
    from hpctrain.parallel.meta import on_meta

    model = on_meta(lambda: build_model(cfg.model.name, cfg.model.num_classes, config=cfg.model, task=CAUSAL_LM))
    if isinstance(getattr(model, "blocks", None), nn.ModuleList):
        return
    what = " and ".join(f"parallel.{key}={value} ({kind} parallel)" for key, value, kind
                        in (("tp", plan.tp, "tensor"), ("pp", plan.pp, "pipeline")) if value > 1)
    raise ConfigError(f"{what} needs a plan for the model's layout (its transformer blocks as `blocks`, an "
                      f"nn.ModuleList, see docs/parallel.md); model.name={cfg.model.name} "
                      f"({type(model).__name__}) has none; hint: parallel.tp=1 parallel.pp=1 with "
                      "parallel.strategy=ddp, fsdp, zero1 or deepspeed (fsdp shards it a transformer block at a time)")


def strategy_name(cfg: Config) -> str:
    """The registered strategy that runs ``cfg``: pipeline stages (around the data-parallel
    strategy of each stage) when ``parallel.pp > 1``, FSDP with CPU offload when asked,
    else ``parallel.strategy`` itself."""
    return _strategy_name(cfg.parallel)


def _strategy_name(p: ParallelConfig) -> str:
    if p.pp > 1:
        return "pipeline"
    if p.cpu_offload:
        return "fsdp_offload"
    return p.strategy


def plan_for(cfg: ParallelConfig, env: ClusterEnv, *, micro_batch: int = 1, grad_accum: int = 1) -> Plan:
    """A plan from the ``parallel`` section alone, for the library functions
    (:func:`hpctrain.parallel.parallelize`) that see no data or checkpoint config."""
    topo = check_topology(cfg, env.world_size, num_nodes=env.num_nodes)
    name = _strategy_name(cfg)
    return Plan(strategy=name, world_size=env.world_size, rank=env.rank, pp=topo.pp, dp_replicate=topo.dp_replicate,
                dp_shard=topo.dp_shard, tp=topo.tp, micro_batch=micro_batch, grad_accum=grad_accum,
                checkpoint_format=strategy_class(name).checkpoint_format(cfg))
