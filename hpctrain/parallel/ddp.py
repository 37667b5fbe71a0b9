"""DistributedDataParallel with its knobs from ``parallel.*``."""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from hpctrain.parallel.config import ParallelConfig


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


def no_sync(model: nn.Module, skip: bool) -> contextlib.AbstractContextManager[None]:
    """Skip the gradient all-reduce (DDP) or reduce-scatter (FSDP) on inner micro-steps of accumulation."""
    from hpctrain.parallel.fsdp import FSDPModule, fsdp_no_sync

    if skip and isinstance(model, DistributedDataParallel):
        return model.no_sync()
    if skip and isinstance(model, FSDPModule):
        return fsdp_no_sync(model)
    return contextlib.nullcontext()
