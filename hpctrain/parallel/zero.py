"""``parallel.strategy=zero1``: the optimizer state sharded over the data-parallel ranks, with
DDP (see ddp.py) doing the gradient all-reduce. PyTorch's ZeroRedundancyOptimizer owns the
sharding: each rank steps its share of the parameters, then broadcasts them to the others."""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer

from hpctrain.core.section import ConfigError
from hpctrain.parallel.ddp import DDP
from hpctrain.parallel.state import ModelState, Zero1State

if TYPE_CHECKING:
    from hpctrain.config import Config
    from hpctrain.core.topology import Topology


def build_zero1(params: Iterable[torch.nn.Parameter], *, optimizer_class: type[torch.optim.Optimizer],
                process_group: Any = None, **defaults: Any) -> ZeroRedundancyOptimizer:
    """``optimizer_class(params, **defaults)`` with its state split over ``process_group``."""
    return ZeroRedundancyOptimizer(list(params), optimizer_class=optimizer_class, process_group=process_group,
                                   parameters_as_bucket_view=False, **defaults)


def zero1_from(optimizer: torch.optim.Optimizer, *, process_group: Any = None) -> ZeroRedundancyOptimizer:
    """The same optimizer (class, hyper-parameters and every param group) as ZeRO-1; build it
    before the first step (the state of ``optimizer`` itself is not carried over)."""
    if optimizer.state:
        raise ValueError("zero1_from needs a fresh optimizer: its state would be lost; convert before the first step")
    first, *rest = optimizer.param_groups
    accepted = inspect.signature(type(optimizer).__init__).parameters
    defaults = {k: v for k, v in first.items() if k != "params" and k in accepted}
    zero = build_zero1(first["params"], optimizer_class=type(optimizer), process_group=process_group, **defaults)
    for group in rest:
        zero.add_param_group(dict(group))
    return zero


class Zero1(DDP):
    """DDP's replicas with ZeroRedundancyOptimizer; checkpoints consolidate the state on rank 0."""

    name = "zero1"

    @classmethod
    def check(cls, cfg: Config, topology: Topology) -> None:
        super().check(cfg, topology)
        if cfg.checkpoint.enabled and cfg.checkpoint.format == "dcp" and topology.world > 1:
            raise ConfigError("parallel.strategy=zero1 checkpoints with checkpoint.format=torch (rank 0 writes the "
                              "optimizer state consolidated from every rank), not dcp; hint: checkpoint.format=torch")

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return zero1_from(optimizer) if self.env.distributed else optimizer

    def checkpoint_state(self) -> ModelState:
        if not self.env.distributed:
            return super().checkpoint_state()
        assert self.optimizer is not None, "setup() first"
        return Zero1State(self.model, self.optimizer, self.name)
