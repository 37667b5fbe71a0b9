"""The ``optim`` config section (optimizer, learning rate, schedule). It lives beside
:mod:`hpctrain.optim` rather than in it, so that reading a config imports no torch.

``optim.name``, ``optim.schedule`` and ``train.loss`` may name user code as
``package.module:NAME``: reading the config only checks that shape; :func:`load_import_path`
imports it when the run is built (so a config stays readable without torch or the user's code)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from hpctrain.core.section import ConfigError, at_least, opt, positive

OPTIMIZERS = ("sgd", "adamw")
SCHEDULES = ("constant", "cosine", "step")


def is_import_path(value: str) -> bool:
    module, sep, attr = value.partition(":")
    return bool(sep and module and attr)


def check_choice_or_path(key: str, value: str, choices: tuple[str, ...], example: str) -> None:
    """``value`` is a built-in name or looks like ``package.module:NAME`` (imported only at build time)."""
    if value not in choices and not is_import_path(value):
        raise ConfigError(f"{key}={value!r} is neither one of {', '.join(choices)} nor an import path "
                          f"package.module:NAME; hint: {key}={example}")


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    name: str = opt("sgd", "Optimizer: sgd or adamw, or any torch.optim.Optimizer class by import path (torch.optim:Adadelta, mypkg.optim:MyOptimizer), built as Class(params, lr=optim.lr) plus optim.kwargs; momentum, nesterov, weight_decay and betas apply to the built-in ones only.")  # noqa: E501 - the help text is the reference
    kwargs: dict[str, Any] = opt({}, "Keyword arguments of an optimizer given by import path, besides params and lr (e.g. optim.kwargs.rho=0.9).")  # noqa: E501 - the help text is the reference
    lr: float = opt(0.1, "Peak learning rate (after warmup and scaling).")
    momentum: float = opt(0.9, "SGD momentum.")
    nesterov: bool = opt(False, "SGD Nesterov momentum.")
    weight_decay: float = opt(0.0, "Weight decay (decoupled for adamw).")
    decay: Literal["all", "matrices"] = opt("all", "Which parameters optim.weight_decay applies to (sgd, adamw): all; or matrices: those of two or more dimensions only (weight matrices, embeddings), not biases nor norm weights (nanoGPT's and most LLM recipes' choice).")  # noqa: E501 - the help text is the reference
    betas: list[float] = opt([0.9, 0.999], "AdamW betas.")
    warmup_steps: int = opt(0, "Linear warmup from 0 to lr over this many optimizer steps.")
    schedule: str = opt("cosine", "LR schedule after warmup: constant, cosine or step (counted in optimizer steps), or any torch.optim.lr_scheduler class by import path (torch.optim.lr_scheduler:StepLR), built as Class(optimizer) plus optim.schedule_kwargs (or a factory of one, called so); it cannot be combined with optim.warmup_steps.")  # noqa: E501 - the help text is the reference
    schedule_kwargs: dict[str, Any] = opt({}, "Keyword arguments of a schedule given by import path, besides the optimizer (e.g. optim.schedule_kwargs.step_size=1).")  # noqa: E501 - the help text is the reference
    schedule_interval: Literal["step", "epoch"] = opt("step", "When a schedule given by import path steps: step = after every optimizer step; epoch = once at the end of every epoch (as scheduler.step() after each epoch in a plain loop).")  # noqa: E501 - the help text is the reference
    min_lr_ratio: float = opt(0.0, "Cosine floor as a fraction of lr.")
    step_size: int = opt(1000, "Step schedule: multiply by gamma every step_size optimizer steps.")
    gamma: float = opt(0.1, "Step schedule decay factor.")
    scale_lr: Literal["none", "linear"] = opt("none", "linear: lr x global_batch / base_batch (Goyal et al.).")
    base_batch: int = opt(64, "Reference global batch for scale_lr=linear.")

    def __post_init__(self) -> None:
        positive("optim", self, "lr", "base_batch", "step_size")
        check_choice_or_path("optim.name", self.name, OPTIMIZERS, "torch.optim:Adadelta")
        check_choice_or_path("optim.schedule", self.schedule, SCHEDULES, "torch.optim.lr_scheduler:StepLR")
        self._check_user_parts()
        if self.decay != "all" and self.name not in OPTIMIZERS:
            raise ConfigError(f"optim.decay={self.decay} applies to the built-in optimizers ({', '.join(OPTIMIZERS)}), "
                              f"not optim.name={self.name}; hint: drop optim.decay, or pass param groups yourself")
        at_least("optim", self, "warmup_steps", 0)
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"optim.min_lr_ratio={self.min_lr_ratio} must be within [0, 1]")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"optim.betas={self.betas} must be two numbers in [0, 1)")

    def _check_user_parts(self) -> None:
        """Keys that only apply to an optimizer / schedule given by import path."""
        if "lr" in self.kwargs:
            raise ConfigError(f"optim.kwargs.lr={self.kwargs['lr']!r}: the learning rate is optim.lr (scaled by "
                              "optim.scale_lr); hint: set optim.lr instead")
        if self.kwargs and self.name in OPTIMIZERS:
            raise ConfigError(f"optim.kwargs={self.kwargs!r} applies to an optimizer given by import path, not "
                              f"optim.name={self.name}; hint: use its own keys (optim.momentum, optim.betas, ...)")
        user_schedule = self.schedule not in SCHEDULES
        if not user_schedule and (self.schedule_kwargs or self.schedule_interval != "step"):
            raise ConfigError(f"optim.schedule_kwargs / optim.schedule_interval apply to a schedule given by import "
                              f"path, not optim.schedule={self.schedule} (counted in optimizer steps; see "
                              "optim.step_size)")
        if user_schedule and self.warmup_steps:
            # Composing would need a rule for when a step-counted warmup hands over to a schedule that
            # may count epochs, and both would write the same lr: refused rather than guessed.
            raise ConfigError(f"optim.warmup_steps={self.warmup_steps} cannot be combined with "
                              f"optim.schedule={self.schedule}; hint: set optim.warmup_steps=0 and put the warmup "
                              "in the schedule (e.g. a factory returning torch.optim.lr_scheduler.SequentialLR)")
