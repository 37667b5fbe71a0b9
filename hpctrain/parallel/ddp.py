"""``parallel.strategy=ddp``: DistributedDataParallel with its knobs from ``parallel.*``; a
whole model on every rank, gradients all-reduced (skipped on inner micro-steps of accumulation)."""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from hpctrain.config.parallel import ParallelConfig
from hpctrain.parallel.base import Strategy


def wrap_ddp(model: nn.Module, cfg: ParallelConfig) -> DistributedDataParallel:
    device = next(model.parameters()).device
    # torch 2.13 renamed broadcast_buffers to forward_sync_buffers; older releases know only the first.
    sync_name = "forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(
        DistributedDataParallel.__init__).parameters else "broadcast_buffers"
    sync: dict[str, Any] = {sync_name: cfg.broadcast_buffers}
    return DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=cfg.bucket_cap_mb,
        gradient_as_bucket_view=cfg.gradient_as_bucket_view,
        static_graph=cfg.static_graph,
        find_unused_parameters=cfg.find_unused_parameters,
        **sync,
    )


class DDP(Strategy):
    """Replicas over the data-parallel ranks (tensor parallel inside them when ``parallel.tp > 1``)."""

    name = "ddp"

    def wrap_data_parallel(self, model: nn.Module) -> nn.Module:
        if self.topology.dp_cp == 1:
            return model  # nothing to replicate (e.g. tp over the whole world); cp ranks average their grads too
        return wrap_ddp(model, self.cfg)

    def no_sync(self) -> contextlib.AbstractContextManager[Any]:
        model = self.model
        return model.no_sync() if isinstance(model, DistributedDataParallel) else contextlib.nullcontext()
