"""The ``optim`` config section (optimizer, learning rate, schedule). It lives beside
:mod:`hpctrain.optim` rather than in it, so that reading a config imports no torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

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
