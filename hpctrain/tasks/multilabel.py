"""``multilabel``: a 0/1 vector of L labels per sample; the model gives L logits.

The loss is binary cross-entropy with logits, the mean over every (sample, label) of the real
samples. A logit above 0 predicts the label present. Validation reports ``loss``, overall and
per-label ``accuracy``, micro ``f1``, ``macro_f1``, ``per_label_f1`` and ``exact_match``, from
per-label true/false positive/negative counts merged across ranks (exact at any world size).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from hpctrain.data.batch import Batch
from hpctrain.tasks.base import CrossEntropyTask
from hpctrain.tasks.metrics import Metric, MultilabelMetrics


class Multilabel(CrossEntropyTask):
    """inputs -> (N, L) logits; targets (N, L) 0/1 floats; BCE-with-logits; F1 and accuracy per label."""

    name = "multilabel"
    best_metric = "val_f1"  # train.best_metric=auto
    input_dtype = torch.float32
    targets = "multilabel"

    def inputs_targets(self, batch: Batch) -> tuple[Any, torch.Tensor]:
        return batch.inputs, batch.targets

    def labels(self, inputs: Any, targets: torch.Tensor) -> torch.Tensor:
        return targets

    def target_losses(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(logits.float(), targets.float(), reduction="none")

    def logits_loss(self, logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        if mask is None:
            return F.binary_cross_entropy_with_logits(logits.float(), targets.float())
        per_sample = self.target_losses(logits, targets).mean(1)
        return (per_sample * mask).sum() / mask.sum().clamp_min(1)

    def metrics(self, num_classes: int) -> list[Metric]:
        return [MultilabelMetrics(num_classes)]

    def tokens_per_sample(self, input_shape: tuple[int, ...]) -> int | None:
        return None
