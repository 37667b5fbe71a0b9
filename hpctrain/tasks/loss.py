"""``train.loss=package.module:NAME``: the user's training loss in place of the task's.

NAME is a callable ``(output, target) -> scalar tensor``, like ``torch.nn.functional:nll_loss``
or an ``nn.Module`` loss instance (``mypkg.losses:focal``). It replaces only the training loss:
inputs and targets still come from the task's ``split`` (the data's targets reach it unchecked,
hpctrain.tasks.data_targets) and validation keeps the task's own metrics, so ``val_loss`` stays
the task's, comparable across runs with any loss; under the ``custom`` task (targets that are
not class ids, no task named) validation reports this loss (hpctrain.tasks.custom).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hpctrain.core.section import ConfigError, load_import_path
from hpctrain.tasks.base import Task

Loss = Callable[[Any, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


class UserLoss:
    """The strategy's loss function around the user's ``(output, target)`` callable. A batch
    with padding (``mask``) passes only its real samples."""

    def __init__(self, fn: Callable[[Any, torch.Tensor], Any], spec: str) -> None:
        self.fn, self.spec = fn, spec

    def __call__(self, output: Any, targets: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        if mask is not None:
            keep = mask.bool()
            output, targets = output[keep], targets[keep]
        value = self.fn(output, targets)
        if not (isinstance(value, torch.Tensor) and value.numel() == 1):
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ConfigError(f"train.loss={self.spec} returned {shape}, not a scalar tensor; hint: reduce it "
                              "(e.g. reduction='mean')")
        return value.reshape(())


def training_loss(task: Task, spec: str | None) -> Loss:
    """The loss the loop trains with: ``train.loss``'s callable, or (None) the task's own."""
    if spec is None:
        return task.loss
    fn = load_import_path("train.loss", spec)
    if isinstance(fn, type) or not callable(fn):
        what = f"class {fn.__name__}" if isinstance(fn, type) else type(fn).__name__
        raise ConfigError(f"train.loss={spec!r} is a {what}, not a loss function (output, target) -> scalar; hint: "
                          "name a function (torch.nn.functional:cross_entropy) or a loss instance made in your "
                          "module (mypkg.losses:LOSS = torch.nn.CrossEntropyLoss())")
    return UserLoss(fn, spec)
