"""Optimizer and learning-rate schedule, and their config section ``optim``."""

from __future__ import annotations

import math

import torch
from torch import nn

from hpctrain.optim_config import OptimConfig


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
