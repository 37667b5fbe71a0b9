"""``classification``: one label per sample; the behaviour of the loop before tasks existed."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hpctrain.data.batch import Batch
from hpctrain.tasks.base import CrossEntropyTask
from hpctrain.tasks.metrics import Metric, default_metrics


def masked_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Mean cross-entropy over the real samples (padding has mask 0). Accepts logits or
    log-probabilities alike (see hpctrain.models.user)."""
    if mask is None:
        return F.cross_entropy(logits, targets)
    losses = F.cross_entropy(logits, targets, reduction="none")
    return (losses * mask).sum() / mask.sum().clamp_min(1)


class Classification(CrossEntropyTask):
    """inputs -> (N, C) logits; targets (N,) class ids; metrics: loss, top-1/top-5, confusion matrix."""

    name = "classification"
    best_metric = "val_accuracy"  # train.best_metric=auto
    input_dtype = torch.float32

    def inputs_targets(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        return batch.inputs, batch.targets

    def labels(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return targets

    def logits_loss(self, logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        if mask is None:  # training batches: the common case, one call less on the hot path
            return F.cross_entropy(logits, targets)
        return masked_cross_entropy(logits, targets, mask)

    def metrics(self, num_classes: int) -> list[Metric]:
        return default_metrics(num_classes)

    def tokens_per_sample(self, input_shape: tuple[int, ...]) -> int | None:
        return None
