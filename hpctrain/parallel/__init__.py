"""Parallel strategies: one object per way of running a model over ranks.

- :mod:`~hpctrain.parallel.mesh`: the one DeviceMesh of the run's
  :class:`~hpctrain.core.topology.Topology` (the run's layout, planned once from the config and
  the environment, is :mod:`hpctrain.planning.layout`, a layer above: it asks the strategies);
- :mod:`~hpctrain.parallel.base`: the :class:`Strategy` interface; one file per strategy
  (``ddp``, ``zero``, ``fsdp``, ``fsdp_offload``, ``deepspeed``, ``pipeline_strategy``),
  found by name in :mod:`~hpctrain.parallel.registry`;
- :mod:`~hpctrain.parallel.state`: model + optimizer as a checkpoint saves them.

The functions below apply a strategy to a model built elsewhere (a hand-written loop), in one
documented order: tensor parallel -> activation checkpointing -> compile -> FSDP / DDP. This
package's import is light: torch loads when a function is called.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hpctrain.config.parallel import ParallelConfig, check_topology
from hpctrain.core.errors import UserError
from hpctrain.core.modules import is_sharded, unwrap
from hpctrain.parallel.registry import make_strategy, strategy_class, strategy_name

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

    from hpctrain.core.env import ClusterEnv
    from hpctrain.core.topology import Topology
    from hpctrain.parallel.base import Strategy
    from hpctrain.parallel.pipeline import PipelineStep

__all__ = ["build_parallel", "build_pipeline_step", "is_sharded", "mesh_for", "parallelize", "strategy_for", "unwrap"]


def strategy_for(cfg: ParallelConfig | str, env: ClusterEnv, device: torch.device, *, compile: bool = False,
                 precision: str = "fp32", seed: int = 0, mesh: DeviceMesh | None = None) -> Strategy:
    """The registered strategy for ``parallel.*`` on this world (built once; it owns the mesh).
    ``cfg`` may be a strategy's name alone (``"fsdp"``): ``ParallelConfig(strategy=name)``."""
    if isinstance(cfg, str):
        cfg = ParallelConfig(strategy=cfg)
    topology = check_topology(cfg, env.world_size, num_nodes=env.num_nodes)
    return make_strategy(strategy_name(cfg), topology, env, device, cfg, precision=precision, compile=compile,
                         seed=seed, mesh=mesh)


def mesh_for(env: ClusterEnv, cfg: ParallelConfig, device_type: str = "cpu") -> tuple[Topology, DeviceMesh]:
    """The checked topology and its DeviceMesh (``pp``, ``dp`` [or replicate x shard], ``tp``)."""
    from hpctrain.parallel.mesh import build_mesh  # torch: the package's import stays light

    topo = check_topology(cfg, env.world_size, num_nodes=env.num_nodes)
    return topo, build_mesh(topo, device_type)


def parallelize(model: nn.Module, env: ClusterEnv, cfg: ParallelConfig, *, compile: bool = False,
                precision: str = "fp32", mesh: DeviceMesh | None = None) -> nn.Module:
    """The model ready for training on this rank (moved to its device beforehand, or on meta
    for :func:`build_parallel`). ``mesh``: one from :func:`mesh_for`, else built here."""
    if cfg.pp > 1:
        raise UserError("parallel.pp > 1 runs through a pipeline step function, not a wrapped model; "
                        "hint: use hpctrain.parallel.build_pipeline_step")
    strategy = strategy_for(cfg, env, _device(model), compile=compile, precision=precision, mesh=mesh)
    return strategy.parallelize(model)


def _device(model: nn.Module) -> torch.device:
    import torch

    param = next(model.parameters(), None)
    if param is None or param.device.type == "meta":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return param.device


def build_parallel(factory: Callable[[], nn.Module], env: ClusterEnv, cfg: ParallelConfig, *,
                   device: torch.device, seed: int, compile: bool = False, precision: str = "fp32",
                   mesh: DeviceMesh | None = None) -> nn.Module:
    """``factory()``'s model parallelized, with the weights of ``torch.manual_seed(seed); factory()``
    in one process; with ``parallel.meta_init`` no rank ever holds the full model on ``device``."""
    strategy = strategy_for(cfg, env, device, compile=compile, precision=precision, seed=seed, mesh=mesh)
    return strategy.build_model(factory)


def build_pipeline_step(model: nn.Module, env: ClusterEnv, cfg: ParallelConfig, *, device: torch.device,
                        loss_fn: Callable[[Any, Any], Any], grad_accum: int = 1, precision: str = "fp32",
                        mesh: DeviceMesh | None = None) -> PipelineStep:
    """``parallel.pp > 1``: this rank's stage(s) of ``model`` (tensor parallel, activation
    checkpointing and FSDP over dp applied per stage) behind a step function."""
    from hpctrain.parallel.pipeline_strategy import Pipeline  # torch: the package's import stays light

    topology = check_topology(cfg, env.world_size, num_nodes=env.num_nodes)
    strategy = Pipeline(topology, env, device, cfg, grad_accum=grad_accum, precision=precision, mesh=mesh,
                        stage=strategy_class(cfg.strategy))
    strategy.loss_fn = lambda out, tgt, mask: loss_fn(out, tgt)
    strategy.build_model(lambda: model)
    assert strategy.step is not None
    return strategy.step

