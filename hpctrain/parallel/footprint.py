"""Bytes this rank holds for parameters, gradients and optimizer state (local shards only),
the quantities the sharding strategies divide; activations are measured separately."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def tensor_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    return sum(_local_bytes(t) for t in tensors if t is not None)


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """``{"params", "grads", "optimizer"}`` bytes on this rank (ZeroRedundancyOptimizer: its local shard)."""
    params = list(model.parameters())
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps its shard's optimizer in .optim
    states = inner.state.values() if inner is not None else []
    opt_tensors = [v for state in states for v in state.values() if isinstance(v, torch.Tensor)]
    return {"params": tensor_bytes(params), "grads": tensor_bytes(p.grad for p in params),
            "optimizer": tensor_bytes(opt_tensors)}
