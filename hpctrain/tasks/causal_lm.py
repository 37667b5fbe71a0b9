"""``causal_lm``: next-token prediction on windows of ``seq_len + 1`` tokens.

A batch holds int64 windows ``w`` of shape ``(N, T + 1)`` (see :mod:`hpctrain.data.text`);
the model reads ``w[:, :-1]`` and predicts ``w[:, 1:]``. The loss is the mean token
cross-entropy over the real samples' tokens (masked samples excluded). Evaluation reports
the mean loss per token, perplexity ``exp(loss)``, token accuracy (``accuracy``, next-token
argmax), ``tokens`` and ``count`` (samples), all from sums and counts merged across ranks.

Packed documents (``data.packing=documents``, :mod:`hpctrain.data.packed`): a window comes with
per-token document ids, as dict inputs ``{tokens, doc_ids}`` (in memory) or stacked ``(N, 2, T + 1)``
(shards). The model then reads ``{"tokens": (N, T) int64, "doc_ids": (N, T) int32}`` (ids
non-decreasing; padding carries the id ``T``, past every document's) and masks attention within
a document (a model whose forward names no ``doc_ids`` gets the tokens alone: attention crosses
documents, which :mod:`hpctrain.tasks.inputs` warns about once). A target whose token starts
another document, or is padding, is -100: the loss never predicts across a boundary, and
throughput counts the real (non-padding) tokens.

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
from hpctrain.data.packed import PAD_DOC
from hpctrain.models.moe import with_aux_loss
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
        packed = packed_windows(windows)
        if packed is not None:
            return packed_split(*packed)
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
        if "doc_ids" in inputs:  # the first token of a document is not predicted from the one before
            docs = inputs["doc_ids"]
            start = torch.cat([torch.zeros_like(docs[:, :1], dtype=torch.bool), docs[:, 1:] != docs[:, :-1]], 1)
            return inputs["tokens"].masked_fill(start | (docs >= docs.shape[1]), IGNORE_INDEX)
        pad = padding_positions(inputs)
        ids = main_input(inputs)
        return ids if pad is None else ids.masked_fill(pad, IGNORE_INDEX)

    def loss(self, output: Any, targets: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        # a mixture of experts' load-balancing loss trains with the task's (the hook: hpctrain.models.moe)
        return with_aux_loss(super().loss(output, targets, mask), output)

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
        if isinstance(inputs, dict) and "doc_ids" in inputs:  # packed: every token read but padding
            return (inputs["doc_ids"] < inputs["doc_ids"].shape[1]).sum()
        return (targets != IGNORE_INDEX).sum()  # the targets that count: padding skipped

    def metrics(self, num_classes: int) -> list[Metric]:
        return [TokenMetrics()]

    def tokens_per_sample(self, input_shape: tuple[int, ...]) -> int | None:
        return int(input_shape[0])  # targets per sample: the (seq_len,) the model reads


def packed_windows(windows: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A batch of packed windows as ``(tokens, doc_ids)``, each ``(N, T + 1)``; None for plain windows."""
    if isinstance(windows, dict):
        return (windows["tokens"], windows["doc_ids"]) if "doc_ids" in windows and "tokens" in windows else None
    if windows.ndim == 3 and windows.shape[1] == 2:  # shards: tokens and doc ids stacked (hpctrain.data.text)
        return windows[:, 0], windows[:, 1]
    return None


def packed_split(tokens: torch.Tensor, doc_ids: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The model's ``{tokens, doc_ids}`` and the targets: -100 where the next token starts another
    document or is padding. Padding's doc id becomes ``T``, so the ids stay non-decreasing and a
    block-diagonal mask keeps padding apart from every document."""
    width = tokens.shape[1] - 1
    docs = doc_ids.masked_fill(doc_ids == PAD_DOC, width).int()
    crossing = (docs[:, 1:] != docs[:, :-1]) | (docs[:, 1:] >= width)
    return {"tokens": tokens[:, :-1], "doc_ids": docs[:, :-1]}, tokens[:, 1:].masked_fill(crossing, IGNORE_INDEX)
