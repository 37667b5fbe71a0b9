"""Bytes this rank holds for parameters, gradients and optimizer state (local shards only),
the quantities the sharding strategies divide; activations are measured by
:mod:`hpctrain.telemetry.memory`.

Counted as memory is held: each distinct storage once, whole (FSDP2's padding, DeepSpeed's
flat buffers and alignment, DDP's gradient buckets included), so two views of one buffer
are not counted twice. Works for torch optimizers (ZeroRedundancyOptimizer: its local
shard), FSDP2 / tensor-parallel DTensors (their local shards), pipeline stages (the stage's
modules) and a DeepSpeed engine: its module holds the (bf16 or fp32) parameters, ZeRO-3's
partitions in ``param.ds_tensor``; its ZeRO optimizer (``engine.optimizer``) wraps the torch
optimizer whose parameters are the fp32 master partitions and whose state holds the moments.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from hpctrain.parallel.wrappers import local_part as _local

StorageKey = tuple[str, int]


def storage_key(tensor: torch.Tensor) -> StorageKey | None:
    """Where the tensor's memory lives (None: no memory, e.g. meta or freed). A wrapper subclass
    without storage of its own (a not-yet-waited collective's result) lives in its inner tensor."""
    local = _local(tensor)
    if is_traceable_wrapper_subclass(local):
        inner = local.__tensor_flatten__()[0]
        return storage_key(getattr(local, inner[0])) if inner else None
    if local.device.type == "meta":
        return None
    storage = local.untyped_storage()
    return (str(local.device), storage.data_ptr()) if storage.nbytes() else None


def distinct_bytes(tensors: Iterable[torch.Tensor | None], exclude: set[StorageKey] | None = None) -> int:
    """Bytes of the distinct storages behind ``tensors``, leaving out those in ``exclude``."""
    seen: dict[StorageKey, int] = {}
    for tensor in tensors:
        if tensor is None:
            continue
        key = storage_key(tensor)
        if key is not None and key not in (exclude or set()):
            seen[key] = _local(tensor).untyped_storage().nbytes()
    return sum(seen.values())


def tensor_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Element bytes of the (local) tensors, views counted as their own size."""
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors if t is not None)


def is_deepspeed_engine(model: nn.Module) -> bool:
    return hasattr(model, "zero_optimization_stage") and isinstance(getattr(model, "module", None), nn.Module)


def _module(model: nn.Module) -> nn.Module:
    """The module whose parameters the rank holds (a DeepSpeed engine's ``.module``)."""
    inner = getattr(model, "module", None)
    return inner if is_deepspeed_engine(model) and isinstance(inner, nn.Module) else model


def param_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The tensors holding this rank's parameters: local shards; under ZeRO-3 each partition
    (``ds_tensor``) and the parameter itself, empty outside its forward unless DeepSpeed keeps
    it whole on every rank (parameters under ``stage3_param_persistence_threshold``)."""
    out: list[torch.Tensor] = []
    for p in _module(model).parameters():
        out.append(p)
        partition = getattr(p, "ds_tensor", None)
        if isinstance(partition, torch.Tensor):
            out.append(partition)
    return out


def base_optimizer(model: nn.Module, optimizer: Any = None) -> torch.optim.Optimizer | None:
    """The torch optimizer that holds the state: ZeroRedundancyOptimizer's local ``.optim``;
    under DeepSpeed the one its ZeRO optimizer wraps (``engine.optimizer.optimizer``)."""
    if optimizer is None and is_deepspeed_engine(model):
        optimizer = getattr(model.optimizer, "optimizer", model.optimizer)
    inner = getattr(optimizer, "optim", optimizer)
    return inner if isinstance(inner, torch.optim.Optimizer) else None


def _optimizer_params(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]] if optimizer is not None else []


def grad_bytes(model: nn.Module, optimizer: Any = None) -> int:
    """Gradients this rank holds now: the module's ``.grad`` and, where the optimizer steps
    other tensors (DeepSpeed's fp32 partitions), theirs."""
    tensors = [p.grad for p in _module(model).parameters()]
    tensors += [p.grad for p in _optimizer_params(base_optimizer(model, optimizer))]
    return distinct_bytes(tensors)


def optimizer_bytes(model: nn.Module, optimizer: Any = None) -> int:
    """The optimizer's state (moments, step counters) and any parameter copies it steps that the
    module does not hold (DeepSpeed's fp32 master partitions)."""
    inner = base_optimizer(model, optimizer)
    if inner is None:
        return 0
    state = [v for s in inner.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    own = {k for k in map(storage_key, param_tensors(model)) if k is not None}
    return distinct_bytes([*state, *_optimizer_params(inner)], exclude=own)


def state_bytes(model: nn.Module, optimizer: Any = None) -> dict[str, int]:
    """``{"params", "grads", "optimizer"}`` bytes on this rank, each distinct storage once."""
    return {"params": distinct_bytes(param_tensors(model)), "grads": grad_bytes(model, optimizer),
            "optimizer": optimizer_bytes(model, optimizer)}
