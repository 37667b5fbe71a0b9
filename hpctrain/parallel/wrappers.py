"""What a parallelized model is made of: the user's module inside wrappers, and whether this
rank holds shards of it."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, TypeGuard

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def is_dtensor(tensor: object) -> TypeGuard[DTensor]:
    """Is this a DTensor (a shard of FSDP2 or tensor parallelism)? Without importing
    ``torch.distributed.tensor`` (0.7 s of every rank's start-up, sympy included): until that
    module is loaded no DTensor can exist, and a DDP or one-process run never loads it."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: a DTensor's local shard, any other tensor itself."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def is_sharded(model: nn.Module) -> bool:
    """Does this rank hold shards (FSDP, tensor parallel) rather than whole parameters? (FSDP's
    parameters are whole between a forward and its backward: ZeRO-2 after an eval forward.)"""
    fsdp = sys.modules.get("torch.distributed.fsdp")  # likewise: no FSDP module before it loads
    return (fsdp is not None and any(isinstance(m, fsdp.FSDPModule) for m in model.modules())) or any(
        is_dtensor(param) for param in model.parameters())


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DDP / torch.compile wrappers (for saving and evaluation)."""
    while True:
        inner = getattr(model, "module", None)
        if not isinstance(inner, nn.Module):  # no `or`: bool() of a compiled module calls its len()
            inner = getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner
