"""DistributedDataParallel with its knobs from ``parallel.*``."""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from hpctrain.config import ParallelConfig


def wrap_ddp(model: nn.Module, cfg: ParallelConfig) -> DistributedDataParallel:
    device = next(model.parameters()).device
    return DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=cfg.bucket_cap_mb,
        gradient_as_bucket_view=cfg.gradient_as_bucket_view,
        static_graph=cfg.static_graph,
        find_unused_parameters=cfg.find_unused_parameters,
        broadcast_buffers=cfg.broadcast_buffers,
    )


def no_sync(model: nn.Module, skip: bool) -> contextlib.AbstractContextManager[None]:
    """Skip DDP's gradient all-reduce on inner micro-steps of gradient accumulation."""
    if skip and isinstance(model, DistributedDataParallel):
        return model.no_sync()
    return contextlib.nullcontext()


def is_ddp(model: nn.Module) -> bool:
    return isinstance(model, (DistributedDataParallel, torch.nn.parallel.DataParallel))
