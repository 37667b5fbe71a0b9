"""Evaluation metrics as mergeable state: integer counts and float64 sums.

The protocol, for built-in and user metrics alike:

* ``reset()`` creates the state tensors (``self.states``: name -> tensor),
* ``update(out)`` adds one batch to them (``out``: :class:`EvalOutput`, padding masked),
* ``merge(states)`` folds the per-rank states, in rank order, into this one,
* ``compute()`` turns the state into ``{name: value}``.

Subclass :class:`Metric` and the default ``merge`` (an element-wise sum) is usually all
you need; never compute a ratio before merging, or rank 0's shard wins again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class EvalOutput:
    """One evaluated batch, already filtered to real (unmasked) samples."""

    logits: torch.Tensor        # (N, C) float
    targets: torch.Tensor       # (N,) int64
    losses: torch.Tensor        # (N,) float64 per-sample loss
    keys: Any = None            # sample keys, when the loader provides them


class Metric:
    """Base class: state tensors summed across batches and ranks."""

    def __init__(self) -> None:
        self.states: dict[str, torch.Tensor] = {}
        self.reset()

    def reset(self) -> None:
        raise NotImplementedError

    def update(self, out: EvalOutput) -> None:
        raise NotImplementedError

    def compute(self) -> dict[str, Any]:
        raise NotImplementedError

    def merge(self, states: list[dict[str, torch.Tensor]]) -> None:
        """Replace this state by the sum of ``states`` (one per rank, in rank order)."""
        for name in self.states:
            total = states[0][name].clone()
            for other in states[1:]:
                total += other[name]
            self.states[name] = total


def _count(value: int = 0) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.int64)


def _sum(shape: tuple[int, ...] = ()) -> torch.Tensor:
    return torch.zeros(shape, dtype=torch.float64)


class MeanLoss(Metric):
    """Sample-mean loss; ``perplexity=True`` adds exp(mean loss) for language models."""

    def __init__(self, perplexity: bool = False) -> None:
        self.perplexity = perplexity
        super().__init__()

    def reset(self) -> None:
        self.states = {"loss_sum": _sum(), "count": _count()}

    def update(self, out: EvalOutput) -> None:
        self.states["loss_sum"] += out.losses.detach().to("cpu", torch.float64).sum()
        self.states["count"] += out.losses.numel()

    def compute(self) -> dict[str, Any]:
        count = int(self.states["count"])
        loss = float(self.states["loss_sum"]) / count if count else math.nan
        result: dict[str, Any] = {"loss": loss, "count": count}
        if self.perplexity:
            result["perplexity"] = math.exp(loss) if count else math.nan
        return result


class Accuracy(Metric):
    """Top-k accuracy; k=1 also reports ``correct`` and ``count``."""

    def __init__(self, k: int = 1) -> None:
        self.k = k
        super().__init__()

    def reset(self) -> None:
        self.states = {"correct": _count(), "count": _count()}

    def update(self, out: EvalOutput) -> None:
        k = min(self.k, out.logits.shape[-1])
        top = out.logits.topk(k, dim=-1).indices
        self.states["correct"] += int((top == out.targets.unsqueeze(-1)).any(-1).sum())
        self.states["count"] += out.targets.numel()

    def compute(self) -> dict[str, Any]:
        correct, count = int(self.states["correct"]), int(self.states["count"])
        accuracy = correct / count if count else math.nan
        if self.k == 1:
            return {"accuracy": accuracy, "correct": correct, "count": count}
        return {f"top{self.k}_accuracy": accuracy}


class ConfusionMatrix(Metric):
    """Confusion matrix (rows: true class, columns: predicted) and per-class accuracy."""

    def __init__(self, num_classes: int) -> None:
        self.num_classes = num_classes
        super().__init__()

    def reset(self) -> None:
        self.states = {"matrix": torch.zeros((self.num_classes, self.num_classes), dtype=torch.int64)}

    def update(self, out: EvalOutput) -> None:
        pred = out.logits.argmax(-1).cpu()
        flat = out.targets.cpu() * self.num_classes + pred
        self.states["matrix"] += torch.bincount(flat, minlength=self.num_classes**2).view_as(self.states["matrix"])

    def compute(self) -> dict[str, Any]:
        matrix = self.states["matrix"]
        totals = matrix.sum(1)
        per_class = [float(matrix[c, c]) / int(totals[c]) if totals[c] else math.nan for c in range(self.num_classes)]
        return {"per_class_accuracy": per_class, "confusion_matrix": matrix.tolist()}


def default_metrics(num_classes: int) -> list[Metric]:
    return [MeanLoss(), Accuracy(1), Accuracy(min(5, num_classes)), ConfusionMatrix(num_classes)]
