"""Apply a parallel strategy to a model. Order, once more strategies arrive: tensor
parallel -> activation checkpointing -> compile -> FSDP / DDP."""

from __future__ import annotations

from torch import nn

from hpctrain.env import ClusterEnv
from hpctrain.parallel.config import ParallelConfig
from hpctrain.parallel.ddp import wrap_ddp


def parallelize(model: nn.Module, env: ClusterEnv, cfg: ParallelConfig, *, compile: bool = False) -> nn.Module:
    """The model ready for training on this rank (moved to its device beforehand)."""
    if compile:
        import torch

        model = torch.compile(model)  # type: ignore[assignment]
    if not env.distributed:
        return model
    if cfg.strategy == "ddp":
        return wrap_ddp(model, cfg)
    raise ValueError(f"parallel.strategy={cfg.strategy!r} is not supported yet")


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DDP / torch.compile wrappers (for saving and evaluation)."""
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner
