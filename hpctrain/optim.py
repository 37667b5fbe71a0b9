"""Optimizer and learning-rate schedule, and their config section ``optim``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from hpctrain.section import ConfigError, at_least, opt, positive


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    name: Literal["sgd", "adamw"] = opt("sgd", "Optimizer: sgd | adamw.")
    lr: float = opt(0.1, "Peak learning rate (after warmup and scaling).")
    momentum: float = opt(0.9, "SGD momentum.")
    nesterov: bool = opt(False, "SGD Nesterov momentum.")
    weight_decay: float = opt(0.0, "Weight decay (decoupled for adamw).")
    betas: list[float] = opt([0.9, 0.999], "AdamW betas.")
    warmup_steps: int = opt(0, "Linear warmup from 0 to lr over this many optimizer steps.")
    schedule: Literal["constant", "cosine", "step"] = opt("cosine", "LR schedule after warmup.")
    min_lr_ratio: float = opt(0.0, "Cosine floor as a fraction of lr.")
    step_size: int = opt(1000, "Step schedule: multiply by gamma every step_size optimizer steps.")
    gamma: float = opt(0.1, "Step schedule decay factor.")
    scale_lr: Literal["none", "linear"] = opt("none", "linear: lr x global_batch / base_batch (Goyal et al.).")
    base_batch: int = opt(64, "Reference global batch for scale_lr=linear.")

    def __post_init__(self) -> None:
        positive("optim", self, "lr", "base_batch", "step_size")
        at_least("optim", self, "warmup_steps", 0)
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"optim.min_lr_ratio={self.min_lr_ratio} must be within [0, 1]")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"optim.betas={self.betas} must be two numbers in [0, 1)")


def peak_lr(cfg: OptimConfig, global_batch: int) -> float:
    """The configured lr, scaled linearly with the global batch when asked (Goyal et al.)."""
    if cfg.scale_lr == "linear":
        return cfg.lr * global_batch / cfg.base_batch
    return cfg.lr


def build_optimizer(model: nn.Module, cfg: OptimConfig, lr: float) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, nesterov=cfg.nesterov,
                               weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=lr, betas=(cfg.betas[0], cfg.betas[1]), weight_decay=cfg.weight_decay)


def lr_factor(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Multiplier of the peak lr at optimizer step ``step`` (0-based)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    after = step - cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    if cfg.schedule == "step":
        return cfg.gamma ** (after // cfg.step_size)
    span = max(1, total_steps - cfg.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(after, span) / span))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig,
                    total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg, total_steps))
