"""What a model returns, as the tasks read it, and the labels a model that computes its own loss gets.

Models return logits in many wrappers: a tensor; a tuple (``return_dict=False`` in Hugging Face,
or ``(logits, aux)``: the first element); a dict or a transformers ``ModelOutput`` (a dict
subclass: its ``logits``). :func:`logits_of` takes them all, so training, evaluation and the
dummy-forward check read one tensor. :func:`loss_of` is the model's own ``loss`` field (a dict or
``ModelOutput`` only: a tuple's first element is the logits).

``model.use_model_loss=true`` (Hugging Face style: ``model(input_ids, labels=...)`` returns
``loss``): the task attaches the labels to the input tensor it hands the strategy
(:func:`attach_labels`), and a forward pre-hook on the user's model (:func:`pass_labels`) turns
them into ``labels=``. The labels travel on the input tensor because the strategies (DDP, FSDP2,
DeepSpeed) call the model with the one positional input and pass that same tensor object through
(integer ids are never cast or moved again), so no strategy needs to know about labels, and
evaluation, which attaches none, gets logits only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from hpctrain.core.errors import UserError

IGNORE_INDEX = -100  # the label Hugging Face's (and torch's) cross-entropy skips: padding samples
_LABELS = "_hpctrain_labels"  # the attribute an input tensor carries its labels in


class OutputError(UserError):
    """A model's output holds no logits (exit 2); the message says what it returned."""


def logits_of(output: Any) -> torch.Tensor:
    """The logits in ``output``: itself (a tensor), a tuple's first element, a mapping's ``logits``."""
    found = output
    if isinstance(output, Mapping):
        found = output.get("logits")
    elif isinstance(output, (tuple, list)) and output:
        found = output[0]
    if isinstance(found, torch.Tensor):
        return found
    raise OutputError(f"the model returned {describe(output)}; expected logits: a tensor, a tuple whose first "
                      "element is the logits, or a dict / ModelOutput with `logits`")


def loss_of(output: Any) -> torch.Tensor | None:
    """The model's own loss: a mapping's (or ModelOutput's) ``loss`` when it is a tensor, else None."""
    loss = output.get("loss") if isinstance(output, Mapping) else None
    return loss if isinstance(loss, torch.Tensor) else None


def describe(output: Any) -> str:
    """A short name of what a forward returned, for messages."""
    if isinstance(output, torch.Tensor):
        return f"a tensor of shape {tuple(output.shape)}"
    if isinstance(output, Mapping):
        return f"a {type(output).__name__} with keys {list(output)}"
    if isinstance(output, (tuple, list)):
        return f"a {type(output).__name__} of {len(output)}"
    return f"a {type(output).__name__}"


def attach_labels(inputs: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``inputs`` carrying ``labels`` for a model that computes its own loss; a padding sample's
    labels (mask 0) are ``IGNORE_INDEX``, so the model's loss skips them as the task's does."""
    if mask is not None:
        labels = labels.masked_fill(~mask.bool().view(-1, *([1] * (labels.dim() - 1))), IGNORE_INDEX)
    setattr(inputs, _LABELS, labels)
    return inputs


def _labels_hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                 ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    labels = getattr(args[0], _LABELS, None) if len(args) == 1 else None
    if labels is None or "labels" in kwargs:
        return None
    return args, {**kwargs, "labels": labels}


def pass_labels(model: nn.Module) -> RemovableHandle:
    """``model(inputs)`` becomes ``model(inputs, labels=...)`` when the task attached labels."""
    return model.register_forward_pre_hook(_labels_hook, with_kwargs=True)
