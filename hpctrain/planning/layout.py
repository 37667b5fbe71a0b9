"""One layout per run, computed once from the config and the cluster environment before anything
is built: the topology (:class:`~hpctrain.core.topology.Topology`: the mesh's dimensions, this
rank's place in data parallelism, the FLOP divisor), the batch split, the strategy and the
checkpoint format. Data, parallel, telemetry and checkpointing read it; nothing derives these
values again or patches them afterwards.

The planner asks the strategy class (:meth:`~hpctrain.parallel.base.Strategy.checkpoint_format`,
:meth:`~hpctrain.parallel.base.Strategy.check`); the application (the trainer) hands the
layout's topology and batch split to the strategy it builds (:func:`build_strategy`), so no
strategy imports the planner.

Pure arithmetic (no torch): a login node can print a layout without importing torch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from hpctrain.config import Config, check_world, for_world
from hpctrain.config.parallel import AUTO, check_topology
from hpctrain.core.section import ConfigError
from hpctrain.core.topology import Topology
from hpctrain.parallel.registry import make_strategy, strategy_class, strategy_name

if TYPE_CHECKING:
    import torch

    from hpctrain.config.parallel import ParallelConfig
    from hpctrain.core.env import ClusterEnv
    from hpctrain.parallel.base import Strategy

log = logging.getLogger("hpctrain")


@dataclass(frozen=True)
class RunLayout:
    """How this world runs the job. ``topology.dp`` replicas each read their own batches; the tp
    ranks and pipeline stages of one replica share its batches (the mesh lays ranks out as
    :meth:`Topology.dims` says, tp innermost)."""

    strategy: str          # the registered strategy (hpctrain.parallel.registry)
    topology: Topology
    rank: int
    micro_batch: int       # samples per rank per micro-step
    grad_accum: int        # micro-steps per optimizer step
    checkpoint_format: str  # torch (rank 0 writes whole state) | dcp (every rank its shards) | deepspeed

    @property
    def world_size(self) -> int:
        return self.topology.world

    @property
    def dp(self) -> int:
        """Data-parallel replicas (telemetry's ``BatchShape``)."""
        return self.topology.dp

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel replica: its coordinate on the ``dp`` dim of the mesh."""
        return self.topology.dp_rank(self.rank)

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step over the whole job (every replica, every micro-step)."""
        return self.micro_batch * self.grad_accum * self.dp

    @property
    def flops_divisor(self) -> int:
        """The share of its replica's FLOPs one rank runs (telemetry's ``BatchShape``): the topology's."""
        return self.topology.flop_divisor

    def data_env(self, env: ClusterEnv) -> ClusterEnv:
        """The world as the data and the evaluation see it: one rank per data-parallel replica.
        The node fields stay the process's own: staging and indexing still run once per node."""
        if self.dp == env.world_size:
            return env
        return replace(env, rank=self.dp_rank, world_size=self.dp)


def make_layout(cfg: Config, env: ClusterEnv) -> tuple[Config, RunLayout]:
    """The config as this world runs it (``data.global_batch_size`` resolved to the micro-batch
    and accumulation, the checkpoint format a sharded strategy needs) and the run's layout.
    Checks that need the world size fail here, every rank alike, before any process group.
    ``parallel.strategy=auto`` must be resolved before (:func:`hpctrain.planning.auto.resolve_auto`:
    the model measured on the meta device, the same choice on every rank; the trainer does it)."""
    p = cfg.parallel
    if p.strategy == AUTO:
        raise ConfigError("parallel.strategy=auto is chosen before the layout; hint: cfg = "
                          "hpctrain.planning.auto.resolve_auto(cfg, env), then make_layout(cfg, env)")
    cfg, topo = world_layout(cfg, env)
    name = strategy_name(p)
    kind = strategy_class(name)
    fmt = kind.checkpoint_format(p)
    if cfg.checkpoint.enabled and fmt == "dcp" and cfg.checkpoint.format != "dcp":
        log.info("parallel.strategy=%s%s%s: checkpoint.format=dcp (sharded state)", p.strategy,
                 f", tp={p.tp}" if p.tp > 1 else "", f", pp={p.pp}" if p.pp > 1 else "")
        cfg = replace(cfg, checkpoint=replace(cfg.checkpoint, format="dcp"))
    layout = RunLayout(strategy=name, topology=topo, rank=env.rank, micro_batch=cfg.data.batch_size,
                       grad_accum=cfg.train.grad_accum,
                       checkpoint_format=fmt if fmt != "torch" else cfg.checkpoint.format)
    check_model_layout(cfg, topo)
    kind.check(cfg, topo)
    return cfg, layout


def world_layout(cfg: Config, env: ClusterEnv) -> tuple[Config, Topology]:
    """The checks of :func:`make_layout` that need only the world (no strategy class, no torch):
    the topology and the batch split over its data-parallel replicas; the config with the split."""
    topo = check_topology(cfg.parallel, env.world_size, num_nodes=env.num_nodes)  # not dp x tp x pp: exit 2
    check_world(cfg, topo.dp)  # the global batch is split over the dp replicas only
    return for_world(cfg, topo.dp), topo


def check_model_layout(cfg: Config, topology: Topology) -> None:
    """Tensor and pipeline parallelism cut a model by its family's plans (hpctrain.models.family):
    transformer blocks as ``blocks`` (an ``nn.ModuleList``, the default family's), a Hugging Face
    Llama/Mistral/Qwen2, or a family of the user's. A user's model without a plan (a Hugging Face
    GPT-2, a CNN) is refused here, exit 2, before any process group: it is built on meta (no
    memory; placeholder sizes, only its layout is read)."""
    if not (topology.model_split and ":" in cfg.model.name):
        return
    # here, not above: they load torch, which planning a layout on a login node does not need
    from hpctrain.models import build_model
    from hpctrain.models.family import family_of
    from hpctrain.models.user import CAUSAL_LM
    from hpctrain.parallel.meta import meta_structure

    model = meta_structure(lambda: build_model(cfg.model.name, cfg.model.num_classes, config=cfg.model,
                                               task=CAUSAL_LM))
    if model is None:
        return  # a factory that loads weights: checked on rank 0's structure after start
    family = family_of(model)  # its model family's plans (hpctrain.models.family)
    if (topology.tp == 1 or family.tensor_plan_of(model) is not None) and \
            (topology.pp == 1 or family.pipeline_split_of(model) is not None):
        return
    what = " and ".join(f"parallel.{key}={value} ({kind} parallel)" for key, value, kind
                        in (("tp", topology.tp, "tensor"), ("pp", topology.pp, "pipeline")) if value > 1)
    raise ConfigError(f"{what} needs a plan for the model's layout (its transformer blocks as `blocks`, an "
                      f"nn.ModuleList, or a model family's, see docs/models.md); model.name={cfg.model.name} "
                      f"({type(model).__name__}) has none; hint: parallel.tp=1 parallel.pp=1 with "
                      "parallel.strategy=ddp, fsdp, zero1 or deepspeed (fsdp shards it a transformer block at a time)")


def layout_for(cfg: ParallelConfig, env: ClusterEnv, *, micro_batch: int = 1, grad_accum: int = 1) -> RunLayout:
    """A layout from the ``parallel`` section alone (no data or checkpoint config: a library
    caller's, a benchmark's)."""
    topo = check_topology(cfg, env.world_size, num_nodes=env.num_nodes)
    name = strategy_name(cfg)
    return RunLayout(strategy=name, topology=topo, rank=env.rank, micro_batch=micro_batch, grad_accum=grad_accum,
                     checkpoint_format=strategy_class(name).checkpoint_format(cfg))


def build_strategy(layout: RunLayout, env: ClusterEnv, device: torch.device, cfg: ParallelConfig,
                   **options: Any) -> Strategy:
    """The layout's strategy, given its topology and batch split (``options``: the Strategy's
    other keywords: precision, compile, seed, clip_grad_norm, mesh)."""
    return make_strategy(layout.strategy, layout.topology, env, device, cfg, micro_batch=layout.micro_batch,
                         grad_accum=layout.grad_accum, **options)
