"""``causal_lm``: next-token prediction on windows of ``seq_len + 1`` tokens.

A batch holds int64 windows ``w`` of shape ``(N, T + 1)`` (see :mod:`hpctrain.data.text`);
the model reads ``w[:, :-1]`` and predicts ``w[:, 1:]``. The loss is the mean token
cross-entropy over the real samples' tokens (masked samples excluded). Evaluation reports
the mean loss per token, perplexity ``exp(loss)``, token accuracy (``accuracy``, next-token
argmax), ``tokens`` and ``count`` (samples), all from sums and counts merged across ranks.

Windows may come with an ``attention_mask`` (dict inputs ``{input_ids, attention_mask}``): a
target position whose token is padding (mask 0), and any target already -100, counts nowhere:
not in the loss, not in the metrics, not in the tokens of throughput.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from hpctrain.data.batch import Batch, main_input
from hpctrain.tasks.base import CrossEntropyTask
from hpctrain.tasks.inputs import IGNORE_INDEX, ModelInputs, padding_positions
from hpctrain.tasks.metrics import EvalOutput, Metric


class TokenMetrics(Metric):
    """Per-token loss, perplexity and accuracy; ``out`` holds (N, T) targets and losses; a
    target of -100 (padding) counts nowhere."""

    def reset(self) -> None:
        self.states = {"loss_sum": torch.zeros((), dtype=torch.float64), "tokens": torch.tensor(0),
                       "correct": torch.tensor(0), "samples": torch.tensor(0)}

    def update(self, out: EvalOutput) -> None:
        real = out.targets != IGNORE_INDEX
        self.states["loss_sum"] += out.losses.detach().to("cpu", torch.float64)[real.cpu()].sum()
        self.states["tokens"] += int(real.sum())
        self.states["correct"] += int(((out.logits.argmax(-1) == out.targets) & real).sum())
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
    targets = "tokens"

    def inputs_targets(self, batch: Batch) -> tuple[Any, torch.Tensor]:
        windows = batch.inputs
        if not isinstance(windows, dict):
            return windows[:, :-1], windows[:, 1:]
        inputs = {k: v[:, :-1] for k, v in windows.items()}
        targets = main_input(windows)[:, 1:]
        pad = padding_positions(windows)
        return inputs, targets if pad is None else targets.masked_fill(pad[:, 1:], IGNORE_INDEX)

    def labels(self, inputs: Any, targets: torch.Tensor) -> torch.Tensor:
        # Hugging Face causal LMs shift the labels themselves (labels = input_ids): their loss
        # covers the T - 1 next tokens inside the inputs, not the window's last one; padding -100
        if not isinstance(inputs, (dict, ModelInputs)):
            return inputs
        pad = padding_positions(inputs)
        ids = main_input(inputs)
        return ids if pad is None else ids.masked_fill(pad, IGNORE_INDEX)

    def logits_loss(self, logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        if mask is None:  # the mean over the targets that count (-100: padding tokens)
            return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)
        targets = targets.masked_fill(~mask.bool().view(-1, 1), IGNORE_INDEX)  # a padding sample counts nowhere
        # 0, not nan, for a batch of padding only (the last step of an uneven epoch)
        return self.target_losses(logits, targets).sum() / (targets != IGNORE_INDEX).sum().clamp_min(1)

    def target_losses(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Unreduced cross-entropy per target token; 0 at a -100 (padding) target."""
        return F.cross_entropy(logits.flatten(0, -2), targets.flatten(), reduction="none",
                               ignore_index=IGNORE_INDEX).view_as(targets)

    def count_tokens(self, inputs: Any, targets: torch.Tensor) -> torch.Tensor | None:
        return (targets != IGNORE_INDEX).sum()  # the targets that count: padding skipped

    def metrics(self, num_classes: int) -> list[Metric]:
        return [TokenMetrics()]

    def tokens_per_sample(self, input_shape: tuple[int, ...]) -> int | None:
        return int(input_shape[0])  # targets per sample: the (seq_len,) the model reads
