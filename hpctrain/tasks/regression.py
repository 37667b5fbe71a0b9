"""``regression``: float targets of any shape per sample; the model predicts them.

The loss is the mean squared error over every target value of the real samples (MSE by
default; ``train.loss`` replaces it for training). A prediction of shape ``(N, 1)`` for
targets ``(N,)`` (a one-output head) is read as ``(N,)``. Validation reports ``loss`` (= MSE),
``mse``, ``rmse``, ``mae`` and ``count`` from sums of squared and absolute errors and counts
merged across ranks, so the numbers equal a one-process computation.
"""

from __future__ import annotations

from typing import Any

import torch

from hpctrain.core.errors import UserError
from hpctrain.data.batch import Batch
from hpctrain.tasks.base import CrossEntropyTask
from hpctrain.tasks.metrics import Metric, RegressionMetrics


def fit_shape(predictions: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``predictions`` in the targets' shape: as they are, or reshaped when they hold one value
    per target ((N, 1) for (N,)); anything else is refused naming both shapes."""
    if predictions.shape == targets.shape:
        return predictions
    if predictions.numel() == targets.numel() and predictions.shape[:1] == targets.shape[:1]:
        return predictions.reshape(targets.shape)
    raise UserError(f"the model's output {tuple(predictions.shape)} does not fit the targets {tuple(targets.shape)} "
                    "(regression: one prediction per target value); hint: make the model's last layer output "
                    "num_classes values (the factory gets num_classes = the values per sample)")


class Regression(CrossEntropyTask):
    """inputs -> predictions of the targets' shape; MSE; metrics: mse, rmse, mae."""

    name = "regression"
    best_metric = "val_loss"  # train.best_metric=auto: the MSE
    input_dtype = torch.float32
    targets = "float"
    checks_output = False  # outputs are read against the targets' shape, not (batch, classes)

    def inputs_targets(self, batch: Batch) -> tuple[Any, torch.Tensor]:
        return batch.inputs, batch.targets

    def labels(self, inputs: Any, targets: torch.Tensor) -> torch.Tensor:
        return targets

    def fit_outputs(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return fit_shape(logits, targets)

    def target_losses(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return (fit_shape(logits, targets) - targets).square()

    def logits_loss(self, logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        errors = self.target_losses(logits.float(), targets.float())
        if mask is None:
            return errors.mean()
        per_sample = errors.flatten(1).mean(1) if errors.dim() > 1 else errors  # equal values per sample
        return (per_sample * mask).sum() / mask.sum().clamp_min(1)

    def metrics(self, num_classes: int) -> list[Metric]:
        return [RegressionMetrics()]

    def tokens_per_sample(self, input_shape: tuple[int, ...]) -> int | None:
        return None
