"""``causal_lm``: next-token prediction on windows of ``seq_len + 1`` tokens.

A batch holds int64 windows ``w`` of shape ``(N, T + 1)`` (see :mod:`hpctrain.data.text`);
the model reads ``w[:, :-1]`` and predicts ``w[:, 1:]``. The loss is the mean token
cross-entropy over the real samples' tokens (masked samples excluded). Evaluation reports
the mean loss per token, perplexity ``exp(loss)``, token accuracy (``accuracy``, next-token
argmax), ``tokens`` and ``count`` (samples), all from sums and counts merged across ranks.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from hpctrain.data.batch import Batch
from hpctrain.evaluation.metrics import EvalOutput, Metric
from hpctrain.tasks.base import CrossEntropyTask


class TokenMetrics(Metric):
    """Per-token loss, perplexity and accuracy; ``out`` holds (N, T) targets and losses."""

    def reset(self) -> None:
        self.states = {"loss_sum": torch.zeros((), dtype=torch.float64), "tokens": torch.tensor(0),
                       "correct": torch.tensor(0), "samples": torch.tensor(0)}

    def update(self, out: EvalOutput) -> None:
        self.states["loss_sum"] += out.losses.detach().to("cpu", torch.float64).sum()
        self.states["tokens"] += out.targets.numel()
        self.states["correct"] += int((out.logits.argmax(-1) == out.targets).sum())
        self.states["samples"] += out.targets.shape[0]

    def compute(self) -> dict[str, Any]:
        tokens, correct = int(self.states["tokens"]), int(self.states["correct"])
        loss = float(self.states["loss_sum"]) / tokens if tokens else math.nan
        return {"loss": loss, "perplexity": math.exp(loss) if tokens else math.nan,
                "accuracy": correct / tokens if tokens else math.nan, "correct": correct, "tokens": tokens,
                "count": int(self.states["samples"])}


class CausalLM(CrossEntropyTask):
    name = "causal_lm"
    best_metric = "val_loss"  # train.best_metric=auto
    input_dtype = torch.long

    def inputs_targets(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        return batch.inputs[:, :-1], batch.inputs[:, 1:]

    def labels(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # Hugging Face causal LMs shift the labels themselves (labels = input_ids): their loss
        # covers the T - 1 next tokens inside the inputs, not the window's last one
        return inputs

    def logits_loss(self, logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        if mask is None:
            return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        per_sample = self.target_losses(logits, targets).mean(1)  # every sample has the same T tokens
        return (per_sample * mask).sum() / mask.sum().clamp_min(1)

    def metrics(self, num_classes: int) -> list[Metric]:
        return [TokenMetrics()]

    def tokens_per_sample(self, input_shape: tuple[int, ...]) -> int | None:
        return int(input_shape[0])  # targets per sample: the (seq_len,) the model reads
