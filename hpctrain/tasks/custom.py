"""``custom``: the user's ``train.loss`` on targets as the data gives them, unchecked.

``train.task=custom`` (and ``auto`` when ``train.loss`` is set and the targets are not class
ids) trains with the user's loss and validates with it: ``val_loss`` is the user's loss of each
batch weighted by its real samples, summed over batches and ranks and divided by the samples
once, which is exact for a loss that is a mean over samples (``reduction='mean'``). Add your own
metrics with ``train.metrics``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hpctrain.core.section import ConfigError
from hpctrain.data.batch import Batch
from hpctrain.models.outputs import logits_of
from hpctrain.precision import Precision
from hpctrain.tasks.base import CrossEntropyTask, select_keys
from hpctrain.tasks.inputs import call_model
from hpctrain.tasks.loss import Loss
from hpctrain.tasks.metrics import EvalOutput, MeanLoss, Metric


class Custom(CrossEntropyTask):
    """Inputs and targets as the data gives them; the user's loss for training and validation."""

    name = "custom"
    best_metric = "val_loss"
    input_dtype = torch.float32
    targets = "any"
    checks_output = False  # outputs are read against the targets' shape, not (batch, classes)

    def __init__(self, loss: Loss | None = None) -> None:
        self.user_loss = loss

    def inputs_targets(self, batch: Batch) -> tuple[Any, torch.Tensor]:
        return batch.inputs, batch.targets

    def labels(self, inputs: Any, targets: torch.Tensor) -> torch.Tensor:
        return targets

    def logits_loss(self, logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return self._loss()(logits, targets, mask)

    def _loss(self) -> Loss:
        if self.user_loss is None:
            raise ConfigError("train.task=custom needs train.loss=package.module:NAME (the loss of your targets)")
        return self.user_loss

    def eval_step(self, net: nn.Module, batch: Batch, precision: Precision | None) -> EvalOutput | None:
        inputs, targets = self.inputs_targets(batch)
        with precision.autocast() if precision else torch.autocast("cpu", enabled=False):
            output = call_model(net, inputs)
        logits = logits_of(output).float()
        keep, keys = batch.mask, batch.keys
        if keep is not None:
            if not bool(keep.any()):
                return None
            logits, targets, keys = logits[keep], targets[keep], select_keys(keys, keep)
        value = self._loss()(logits, targets, None).detach().double()  # the batch's mean over its samples
        return EvalOutput(logits, targets, value.expand(targets.shape[0]).clone(), keys)

    def metrics(self, num_classes: int) -> list[Metric]:
        return [MeanLoss()]

    def tokens_per_sample(self, input_shape: tuple[int, ...]) -> int | None:
        return None
