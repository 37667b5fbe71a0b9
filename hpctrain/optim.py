"""Optimizer and learning-rate schedule, and their config section ``optim``.

Besides the built-in ones, ``optim.name`` and ``optim.schedule`` may name any class by import
path (``torch.optim:Adadelta``, ``torch.optim.lr_scheduler:StepLR``, or the user's own), built
here with ``optim.kwargs`` / ``optim.schedule_kwargs``. Every strategy gets the optimizer from
:func:`build_optimizer` (zero1 rebuilds it around its class, DeepSpeed takes it as the client
optimizer) and the schedule from :func:`build_scheduler`, which it steps after every optimizer
step; a schedule with ``optim.schedule_interval=epoch`` is wrapped in :class:`PerEpoch`, which
passes only the step that ends an epoch on.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from hpctrain.config.optim import OPTIMIZERS, SCHEDULES, ConfigError, OptimConfig
from hpctrain.core.section import load_import_path


class EpochPosition(Protocol):
    """What :func:`epoch_over` reads of the training loader (hpctrain.data.TrainLoader)."""

    batches_done: int

    def __len__(self) -> int: ...


def peak_lr(cfg: OptimConfig, global_batch: int) -> float:
    """The configured lr, scaled linearly with the global batch when asked (Goyal et al.)."""
    if cfg.scale_lr == "linear":
        return cfg.lr * global_batch / cfg.base_batch
    return cfg.lr


def build_optimizer(model: nn.Module, cfg: OptimConfig, lr: float) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    groups = param_groups(params, cfg)
    # torch's default kernels (on the CPU a loop over the tensors): foreach=True measured a few ms less per
    # step on a small model, but met DTensor and plain state in one kernel when a tensor-parallel run
    # resumed another layout's checkpoint (tests/models/test_hf_family_parallel.py); left for issue 43
    foreach = None
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=cfg.momentum, nesterov=cfg.nesterov,
                               weight_decay=cfg.weight_decay, foreach=foreach)
    if cfg.name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=(cfg.betas[0], cfg.betas[1]), weight_decay=cfg.weight_decay,
                                 foreach=foreach)
    kind = load_import_path("optim.name", cfg.name)
    if not (isinstance(kind, type) and issubclass(kind, torch.optim.Optimizer)):
        raise ConfigError(f"optim.name={cfg.name!r} is a {_what(kind)}, not a torch.optim.Optimizer subclass; "
                          f"hint: name the optimizer class (torch.optim:Adadelta), or one of {', '.join(OPTIMIZERS)}")
    optimizer: torch.optim.Optimizer = construct("optim.name", cfg.name, "optim.kwargs", kind, params, lr=lr,
                                                 **cfg.kwargs)
    return optimizer


def param_groups(params: list[nn.Parameter], cfg: OptimConfig) -> list[nn.Parameter] | list[dict[str, Any]]:
    """``optim.decay=matrices``: two groups, weight decay on the parameters of two or more dimensions
    (weight matrices, embeddings) and none on the rest (biases, norm weights), as nanoGPT and most
    LLM recipes; ``all``: one group, every parameter decayed."""
    if cfg.decay == "all":
        return params
    # DTensor shards keep the whole tensor's ndim: every rank groups alike
    matrices: dict[str, Any] = {"params": [p for p in params if p.ndim >= 2]}
    return [matrices, {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]


def _what(obj: Any) -> str:
    return f"class {obj.__name__}" if isinstance(obj, type) else type(obj).__name__


def construct(key: str, value: str, kwargs_key: str, kind: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``kind(*args, **kwargs)``; arguments its signature does not take (or misses) are a
    ConfigError naming ``kwargs_key`` and the parameters it accepts, as is any error it raises."""
    try:
        signature = inspect.signature(kind)
    except (TypeError, ValueError):  # no signature (a C extension): let the call itself say
        signature = None
    if signature is not None:
        accepted = ", ".join(name for name in list(signature.parameters)[len(args):])
        unknown = [k for k in kwargs if k not in signature.parameters]
        if unknown and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values()):
            raise ConfigError(f"{kwargs_key}.{unknown[0]}: {key}={value} takes no argument {unknown[0]!r}; "
                              f"it accepts: {accepted}")
        try:
            signature.bind(*args, **kwargs)
        except TypeError as err:
            raise ConfigError(f"{key}={value} with {kwargs_key}={_shown(kwargs, kwargs_key)}: {err}; it accepts: "
                              f"{accepted}") from None
    try:
        return kind(*args, **kwargs)
    except Exception as err:  # noqa: BLE001 - user code and user values: report with the keys that chose them
        raise ConfigError(f"{key}={value} with {kwargs_key}={_shown(kwargs, kwargs_key)} raised "
                          f"{type(err).__name__}: {err}") from None


def _shown(kwargs: dict[str, Any], kwargs_key: str) -> dict[str, Any]:
    """The user's keyword arguments only (not the lr hpctrain adds), as they were given."""
    return {k: v for k, v in kwargs.items() if not (k == "lr" and kwargs_key == "optim.kwargs")}


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


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int,
                    epoch_over: Callable[[], bool] | None = None) -> LRScheduler:
    """The schedule the strategy steps after every optimizer step. ``epoch_over`` (see
    :func:`epoch_over`) is needed for ``optim.schedule_interval=epoch``."""
    if cfg.schedule in SCHEDULES:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg, total_steps))
    scheduler = user_scheduler(optimizer, cfg)
    if cfg.schedule_interval == "step":
        return scheduler
    if epoch_over is None:
        raise ValueError("optim.schedule_interval=epoch needs epoch_over (hpctrain.optim.epoch_over(loader, accum))")
    return PerEpoch(scheduler, epoch_over)


def user_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig) -> LRScheduler:
    """``optim.schedule`` by import path: an LRScheduler class, or a factory returning one, called
    with the optimizer and ``optim.schedule_kwargs``."""
    key, value = "optim.schedule", cfg.schedule
    kind = load_import_path(key, value)
    hint = ("hint: name a torch.optim.lr_scheduler class (torch.optim.lr_scheduler:StepLR), or one of "
            + ", ".join(SCHEDULES))
    if isinstance(kind, type) and issubclass(kind, ReduceLROnPlateau):
        raise ConfigError(f"{key}={value}: ReduceLROnPlateau steps on a validation metric, which the loop does not "
                          f"pass to a schedule; {hint}")
    if isinstance(kind, type) and not issubclass(kind, LRScheduler) or not callable(kind):
        raise ConfigError(f"{key}={value!r} is a {_what(kind)}, not a torch.optim.lr_scheduler.LRScheduler "
                          f"subclass or a factory of one; {hint}")
    scheduler = construct(key, value, "optim.schedule_kwargs", kind, optimizer, **cfg.schedule_kwargs)
    if not isinstance(scheduler, LRScheduler):
        raise ConfigError(f"{key}={value} returned a {type(scheduler).__name__}, not a "
                          f"torch.optim.lr_scheduler.LRScheduler; {hint}")
    return scheduler


def epoch_over(loader: EpochPosition, accum: int) -> Callable[[], bool]:
    """Is the optimizer step just taken the epoch's last? Fewer than ``accum`` micro-batches
    are left then (the loop drops them: hpctrain.train.accumulation_window). Read from the
    loader's position, so it holds after a resume mid-epoch, also at another world size."""
    return lambda: len(loader) - loader.batches_done < accum


class PerEpoch(LRScheduler):
    """A schedule stepped once per epoch (``optim.schedule_interval=epoch``), as a plain loop
    calls ``scheduler.step()`` after each epoch. The strategy (or DeepSpeed's engine) calls
    :meth:`step` after every optimizer step; only the step that ends an epoch reaches the
    wrapped schedule. Its state is the wrapped schedule's: a resume continues it exactly."""

    def __init__(self, inner: LRScheduler, epoch_over: Callable[[], bool]) -> None:
        # LRScheduler.__init__ is not called: it would step the optimizer's lr once more, and
        # every lr this object reports is the wrapped schedule's
        self.inner, self.epoch_over, self.optimizer = inner, epoch_over, inner.optimizer

    def step(self, epoch: int | None = None) -> None:
        if self.epoch_over():
            self.inner.step()

    def get_last_lr(self) -> list[float | torch.Tensor]:
        return self.inner.get_last_lr()

    def get_lr(self) -> list[float | torch.Tensor]:
        return self.inner.get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)
