"""Tasks: what the loop trains for. ``classification`` (one label per sample), ``causal_lm``
(next-token prediction), ``regression`` (float targets), ``multilabel`` (0/1 vectors) and
``custom`` (the user's ``train.loss`` on targets as given); the data chooses
(``DataBundle.task``) unless a task is named. Tasks are found by name in
:mod:`hpctrain.tasks.registry`; importing this package loads no torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from hpctrain.core.errors import UserError
from hpctrain.tasks.registry import LABELLED, task_class

if TYPE_CHECKING:
    from hpctrain.tasks.base import CrossEntropyTask, Task, select_keys
    from hpctrain.tasks.causal_lm import CausalLM, TokenMetrics
    from hpctrain.tasks.classification import Classification, masked_cross_entropy
    from hpctrain.tasks.custom import Custom
    from hpctrain.tasks.loss import training_loss
    from hpctrain.tasks.multilabel import Multilabel
    from hpctrain.tasks.regression import Regression

__all__ = ["CausalLM", "Classification", "CrossEntropyTask", "Custom", "Multilabel", "Regression", "Task",
           "TokenMetrics", "build_task", "data_targets", "masked_cross_entropy", "resolve_task", "select_keys",
           "training_loss"]

_LAZY = {"CrossEntropyTask": "base", "Task": "base", "select_keys": "base", "CausalLM": "causal_lm",
         "TokenMetrics": "causal_lm", "Classification": "classification", "masked_cross_entropy": "classification",
         "training_loss": "loss", "Custom": "custom", "Multilabel": "multilabel", "Regression": "regression"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"hpctrain.tasks.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'hpctrain.tasks' has no attribute {name!r}")


def build_task(name: str) -> Task:
    """The task by name (``DataBundle.task``, or ``train.task``)."""
    return task_class(name)()


def data_targets(name: str, loss: str | None) -> str:
    """What the data's labels must be for ``train.task=name`` (hpctrain.data.batch.TARGET_KINDS):
    unchecked (``any``) whenever ``train.loss`` is given, else the task's own kind."""
    if loss is not None:
        return "any"
    if name == "auto":
        return "class"  # the data decides; token windows carry no labels to check
    return str(getattr(task_class(name), "targets", "class"))


def resolve_task(name: str, data_task: str, data_name: str, *, loss: str | None = None,
                 class_targets: bool = True) -> Task:
    """``train.task`` against the data: ``auto`` takes the data's task (``custom`` when
    ``train.loss`` is given and the targets are not class ids); a named task must be the data's
    (token windows have no labels, labelled samples no next token); regression, multilabel and
    custom fit any labelled data. ``loss``: train.loss, which ``custom`` validates with."""
    chosen = data_task if name == "auto" else name
    if name == "auto" and loss is not None and data_task == "classification" and not class_targets:
        chosen = "custom"
    labelled = chosen in LABELLED and data_task != "causal_lm"
    if chosen != data_task and not labelled:
        raise UserError(f"train.task={name} does not fit data.name={data_name}, whose samples are for "
                        f"{data_task}; hint: train.task=auto (or {data_task})")
    if chosen == "custom":
        from hpctrain.tasks.custom import Custom  # torch: reading the registry's names (a config check) needs none
        from hpctrain.tasks.loss import UserLoss, training_loss

        if loss is None:
            raise UserError("train.task=custom needs train.loss=package.module:NAME; hint: the loss of your targets")
        user = training_loss(Custom(), loss)
        return Custom(user if isinstance(user, UserLoss) else None)
    return build_task(chosen)
