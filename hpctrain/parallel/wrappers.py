"""What a parallelized model is made of: the user's module inside wrappers, and whether this
rank holds shards of it."""

from __future__ import annotations

from torch import nn


def is_sharded(model: nn.Module) -> bool:
    """Does this rank hold shards (FSDP, tensor parallel) rather than whole parameters? (FSDP's
    parameters are whole between a forward and its backward: ZeRO-2 after an eval forward.)"""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    return any(isinstance(m, FSDPModule) for m in model.modules()) or any(
        isinstance(param, DTensor) for param in model.parameters())


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DDP / torch.compile wrappers (for saving and evaluation)."""
    while True:
        inner = getattr(model, "module", None)
        if not isinstance(inner, nn.Module):  # no `or`: bool() of a compiled module calls its len()
            inner = getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner
