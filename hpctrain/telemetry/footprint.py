"""Bytes this rank holds for parameters, gradients and optimizer state (local shards only),
the quantities the sharding strategies divide; activations are measured by
:mod:`hpctrain.telemetry.memory_breakdown`.

Counted as memory is held: each distinct storage once, whole (FSDP2's padding, DeepSpeed's
flat buffers and alignment, DDP's gradient buckets included), so two views of one buffer
are not counted twice. Works for torch optimizers (ZeroRedundancyOptimizer: its local
shard), FSDP2 / tensor-parallel DTensors (their local shards), pipeline stages (the stage's
modules) and a DeepSpeed engine: its module holds the (bf16 or fp32) parameters, ZeRO-3's
partitions in ``param.ds_tensor``; its ZeRO optimizer (``engine.optimizer``) wraps the torch
optimizer whose parameters are the fp32 master partitions and whose state holds the moments.

torch's ``fully_shard`` (FSDP2) also holds tensors its modules do not show: the parameters it
has gathered whole for a unit's forward or backward, and the whole gradients a rank accumulates
over micro-steps that skip the reduce-scatter (``set_requires_gradient_sync(False)``).
:func:`gathered_params` and :func:`unsharded_grads` read them from its per-parameter
bookkeeping.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from hpctrain.telemetry.measure import StorageKey, storage_bytes, storage_key


def distinct_bytes(tensors: Iterable[torch.Tensor | None], exclude: set[StorageKey] | None = None) -> int:
    """Bytes of the distinct storages behind ``tensors`` held in memory (a meta tensor holds
    none), leaving out those in ``exclude``."""
    seen: dict[StorageKey, int] = {}
    for tensor in tensors:
        if tensor is None:
            continue
        key = storage_key(tensor)
        if key is not None and key[0] != "meta" and key not in (exclude or set()):
            seen[key] = storage_bytes(tensor)
    return sum(seen.values())


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


def sharded_units(model: nn.Module) -> list[nn.Module]:
    """The model's FSDP2 units (``fully_shard`` modules), each gathered whole in turn."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return [m for m in model.modules() if isinstance(m, fsdp.FSDPModule)] if fsdp is not None else []


def _fsdp_params(model: nn.Module) -> list[Any]:
    """torch's ``fully_shard`` bookkeeping of each parameter of the model's FSDP units (its
    ``FSDPParam`` objects). Private to torch: read through getattr, so that a torch that renames
    it makes the count smaller, never the run fail."""
    out: list[Any] = []
    for unit in sharded_units(model):
        state = getattr(unit, "_get_fsdp_state", lambda: None)()
        groups = getattr(state, "_fsdp_param_groups", None) or [getattr(state, "_fsdp_param_group", None)]
        out += [p for group in groups if group is not None for p in getattr(group, "fsdp_params", [])]
    return out


def gathered_params(model: nn.Module) -> list[torch.Tensor]:
    """The parameters FSDP2 holds gathered whole now (a freed one's storage is empty: no bytes)."""
    return [t for p in _fsdp_params(model) if isinstance(t := getattr(p, "_unsharded_param", None), torch.Tensor)]


def unsharded_grads(model: nn.Module) -> list[torch.Tensor | None]:
    """Whole gradients FSDP2 accumulates between micro-steps without a reduce-scatter (in the
    gathered parameter's dtype, or upcast to the reduce dtype)."""
    grads: list[torch.Tensor | None] = [getattr(p, "unsharded_accumulated_grad", None) for p in _fsdp_params(model)]
    return grads + [t.grad for t in gathered_params(model)]


def grad_bytes(model: nn.Module, optimizer: Any = None) -> int:
    """Gradients this rank holds now: the module's ``.grad``, FSDP2's whole ones not yet
    reduce-scattered and, where the optimizer steps other tensors (DeepSpeed's fp32
    partitions), theirs."""
    tensors = [p.grad for p in _module(model).parameters()] + unsharded_grads(model)
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
