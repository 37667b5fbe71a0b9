"""Evaluation metrics as mergeable state: integer counts and float64 sums.

The protocol, for built-in and user metrics alike:

* ``reset()`` creates the state tensors (``self.states``: name -> tensor),
* ``update(out)`` adds one batch to them (``out``: :class:`EvalOutput`, padding masked),
* ``merge(states)`` folds the per-rank states, in rank order, into this one,
* ``compute()`` turns the state into ``{name: value}``.

Subclass :class:`Metric` and the default ``merge`` (an element-wise sum) is usually all
you need; never compute a ratio before merging, or rank 0's shard wins again.

A user metric named by ``train.metrics=package.module:NAME`` (:func:`user_metrics`) is such a
subclass, or a no-argument factory of one: ``reset`` makes zero tensors of sums and counts
(the same names and shapes on every rank, before any batch), ``update`` adds a batch's parts,
and ``compute`` divides once, after the merge over ranks; each key it returns is logged as
``val_<key>``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from hpctrain.core.section import ConfigError, load_import_path


@dataclass
class EvalOutput:
    """One evaluated batch, already filtered to real (unmasked) samples, sample first. What the
    fields hold depends on the task: classification (N, C) logits and (N,) int64 class ids;
    causal_lm (N, T, V) logits and (N, T) token ids (-100: a padding position that counts
    nowhere); regression (N, ...) predictions and float targets of the same shape; multilabel
    (N, L) logits and (N, L) 0/1 float targets. ``losses`` holds float64 per-target losses."""

    logits: torch.Tensor        # the model's outputs (regression: its predictions)
    targets: torch.Tensor       # what it should predict
    losses: torch.Tensor        # float64 per-sample (or per-target) loss
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


class RegressionMetrics(Metric):
    """Mean squared and absolute error over every target value (``loss`` is the MSE), from sums."""

    def reset(self) -> None:
        self.states = {"sse": _sum(), "sae": _sum(), "values": _count(), "count": _count()}

    def update(self, out: EvalOutput) -> None:
        error = out.logits.detach().to("cpu", torch.float64) - out.targets.detach().to("cpu", torch.float64)
        self.states["sse"] += error.square().sum()
        self.states["sae"] += error.abs().sum()
        self.states["values"] += error.numel()
        self.states["count"] += out.targets.shape[0]

    def compute(self) -> dict[str, Any]:
        values = int(self.states["values"])
        mse = float(self.states["sse"]) / values if values else math.nan
        mae = float(self.states["sae"]) / values if values else math.nan
        return {"loss": mse, "mse": mse, "rmse": math.sqrt(mse) if values else math.nan, "mae": mae,
                "count": int(self.states["count"])}


class MultilabelMetrics(Metric):
    """Per-label confusion counts (a logit > 0 is a predicted 1): per-label and overall accuracy,
    micro and macro F1, exact-match share, and the mean BCE over every (sample, label)."""

    def __init__(self, num_labels: int) -> None:
        self.num_labels = num_labels
        super().__init__()

    def reset(self) -> None:
        zeros = torch.zeros(self.num_labels, dtype=torch.int64)
        self.states = {"tp": zeros.clone(), "fp": zeros.clone(), "fn": zeros.clone(), "tn": zeros.clone(),
                       "exact": _count(), "loss_sum": _sum(), "count": _count()}

    def update(self, out: EvalOutput) -> None:
        pred, truth = (out.logits > 0).cpu(), out.targets.cpu() > 0.5
        self.states["tp"] += (pred & truth).sum(0)
        self.states["fp"] += (pred & ~truth).sum(0)
        self.states["fn"] += (~pred & truth).sum(0)
        self.states["tn"] += (~pred & ~truth).sum(0)
        self.states["exact"] += int((pred == truth).all(1).sum())
        self.states["loss_sum"] += out.losses.detach().to("cpu", torch.float64).sum()
        self.states["count"] += out.targets.shape[0]

    def compute(self) -> dict[str, Any]:
        tp, fp, fn, tn = (self.states[k] for k in ("tp", "fp", "fn", "tn"))
        count = int(self.states["count"])
        cells = count * self.num_labels
        per_label_f1 = [_f1(int(a), int(b), int(c)) for a, b, c in zip(tp, fp, fn)]
        return {"loss": float(self.states["loss_sum"]) / cells if cells else math.nan,
                "accuracy": int((tp + tn).sum()) / cells if cells else math.nan,
                "per_label_accuracy": [int(a + b) / count if count else math.nan for a, b in zip(tp, tn)],
                "f1": _f1(int(tp.sum()), int(fp.sum()), int(fn.sum())),
                "macro_f1": sum(per_label_f1) / len(per_label_f1) if per_label_f1 else math.nan,
                "per_label_f1": per_label_f1,
                "exact_match": int(self.states["exact"]) / count if count else math.nan, "count": count}


def _f1(tp: int, fp: int, fn: int) -> float:
    """F1 from counts; 1.0 where a label was never present nor predicted (nothing to get wrong)."""
    return 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 1.0


def user_metrics(spec: str | None) -> list[Metric]:
    """``train.metrics``: comma-separated import paths, each a :class:`Metric` subclass or a
    no-argument factory returning a Metric instance."""
    metrics: list[Metric] = []
    for path in [p.strip() for p in (spec or "").split(",") if p.strip()]:
        obj = load_import_path("train.metrics", path)
        made = _make_metric(path, obj)
        if not isinstance(made, Metric):
            raise ConfigError(f"train.metrics={path!r} gives a {type(made).__name__}, not a Metric; hint: subclass "
                              "hpctrain.tasks.metrics.Metric (reset/update/compute over sums and counts)")
        metrics.append(made)
    return metrics


def _make_metric(path: str, obj: Any) -> Any:
    if isinstance(obj, Metric) or not callable(obj):
        return obj  # one instance shared by the runs of this process: reset() starts every validation
    try:
        return obj()
    except Exception as err:  # noqa: BLE001 - user code: named, one line
        raise ConfigError(f"train.metrics={path!r}: calling it raised {type(err).__name__}: {err}; hint: a Metric "
                          "subclass (or factory) that takes no arguments") from None
