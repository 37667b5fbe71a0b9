"""What every task shares: the protocol the loop and evaluate() call, and one eval step.

A task turns a :class:`~hpctrain.data.Batch` into model inputs and targets, owns the
training loss and the evaluation metrics, and counts FLOPs and tokens per sample. The
loop and evaluate() stay the same for every task (see docs/models.md):

* train: ``inputs, targets = task.split(batch)``; under autocast
  ``loss = task.loss(model(inputs), targets, batch.mask)``; inputs that are a dict of named
  tensors reach the model as ``model(**inputs)`` (:mod:`hpctrain.tasks.inputs`);
* the model's output may be logits, a tuple, a dict or a ``ModelOutput``
  (:func:`hpctrain.models.outputs.logits_of`); one that carries its own ``loss`` (a model
  called with the labels ``split`` attaches, under ``model.use_model_loss=true``) is trained
  with that loss, while evaluation always reads the logits;
* evaluate: ``out = task.eval_step(net, batch, precision)`` (None: a batch of padding
  only), then ``metric.update(out)`` for each of ``task.metrics(num_classes)``.

Loss convention: the training loss is the mean over what counts (real samples; for a
language model, every target token of the real samples), so DDP's gradient average over
ranks of equal batches is the global mean. :class:`EvalOutput` holds per-target values
with the sample first: ``logits (N, ..., C)``, ``targets (N, ...)``, ``losses (N, ...)``
in float64, masked samples already removed, so metrics sum and count exactly across ranks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from hpctrain.data.batch import Batch
from hpctrain.models.outputs import attach_labels, logits_of, loss_of
from hpctrain.precision import Precision
from hpctrain.tasks.inputs import call_model, model_inputs, real_tokens
from hpctrain.tasks.metrics import EvalOutput, Metric
from hpctrain.telemetry.flops import train_step_flops


@runtime_checkable
class Task(Protocol):
    name: str
    best_metric: str  # the validation metric train.best_metric=auto tracks
    input_dtype: torch.dtype  # what the model's forward takes
    targets: str  # what the data's labels must be (hpctrain.data.batch.TARGET_KINDS)

    def split(self, batch: Batch) -> tuple[Any, torch.Tensor]: ...  # (inputs, targets)
    def loss(self, output: Any, targets: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor: ...
    def eval_step(self, net: nn.Module, batch: Batch, precision: Precision | None) -> EvalOutput | None: ...
    def metrics(self, num_classes: int) -> list[Metric]: ...
    def tokens_per_sample(self, input_shape: tuple[int, ...]) -> int | None: ...  # None: not a token task
    def count_tokens(self, inputs: Any, targets: torch.Tensor) -> torch.Tensor | None: ...  # real tokens of a batch
    def flops_per_sample(self, model: nn.Module, input_shape: tuple[int, ...]) -> int: ...


class CrossEntropyTask(ABC):
    """The shared half of the tasks: forward under precision, drop padding, per-target losses.
    (Cross-entropy is the default per-target loss; regression and multilabel replace it.)"""

    name: str
    best_metric: str
    input_dtype: torch.dtype
    targets: str = "class"

    @abstractmethod
    def inputs_targets(self, batch: Batch) -> tuple[Any, torch.Tensor]:
        """What the model reads and what it should predict."""

    @abstractmethod
    def labels(self, inputs: Any, targets: torch.Tensor) -> torch.Tensor:
        """The ``labels=`` a model that computes its own loss takes (Hugging Face's convention)."""

    @abstractmethod
    def logits_loss(self, logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """The task's own training loss on the logits."""

    def split(self, batch: Batch) -> tuple[Any, torch.Tensor]:
        """Training's (inputs, targets); the inputs carry the labels, which reach only a model
        built with ``model.use_model_loss=true`` (padding samples' labels ignored)."""
        inputs, targets = self.inputs_targets(batch)
        inputs = model_inputs(inputs)  # a dict as ModelInputs: it can carry the labels
        return attach_labels(inputs, self.labels(inputs, targets), batch.mask), targets

    def loss(self, output: Any, targets: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """The model's own ``loss`` when its output has one, else the task's on its logits."""
        own = loss_of(output)
        return own if own is not None else self.logits_loss(logits_of(output), targets, mask)

    @abstractmethod
    def metrics(self, num_classes: int) -> list[Metric]: ...

    @abstractmethod
    def tokens_per_sample(self, input_shape: tuple[int, ...]) -> int | None: ...

    def count_tokens(self, inputs: Any, targets: torch.Tensor) -> torch.Tensor | None:
        """Tokens in a micro-batch (a 0-dim tensor on the batch's device: no sync), padding not
        counted (attention_mask 0); None: inputs without a mask, not counted here."""
        return real_tokens(inputs)

    def target_losses(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Unreduced cross-entropy, one value per target (shape of ``targets``)."""
        return F.cross_entropy(logits.flatten(0, -2), targets.flatten(), reduction="none").view_as(targets)

    def fit_outputs(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The outputs as the per-target losses read them (regression: the targets' shape)."""
        return logits

    def eval_step(self, net: nn.Module, batch: Batch, precision: Precision | None) -> EvalOutput | None:
        inputs, targets = self.inputs_targets(batch)  # no labels: exact metrics on the logits
        with precision.autocast() if precision else torch.autocast("cpu", enabled=False):
            output = call_model(net, inputs)
        logits = self.fit_outputs(logits_of(output).float(), targets)
        keep, keys = batch.mask, batch.keys
        if keep is not None:
            if not bool(keep.any()):
                return None
            logits, targets, keys = logits[keep], targets[keep], select_keys(keys, keep)
        return EvalOutput(logits, targets, self.target_losses(logits, targets).double(), keys)

    def flops_per_sample(self, model: nn.Module, input_shape: tuple[int, ...]) -> int:
        """Training FLOPs of one sample (3 x forward; see hpctrain.telemetry.flops), counted on meta."""
        return train_step_flops(model, torch.zeros((1, *input_shape), dtype=self.input_dtype))


def select_keys(keys: torch.Tensor | list[str], keep: torch.Tensor) -> torch.Tensor | list[str]:
    if isinstance(keys, torch.Tensor):
        return keys[keep.cpu()]
    return [k for k, m in zip(keys, keep.tolist()) if m]
