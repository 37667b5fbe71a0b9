"""Tasks: what the loop trains for. ``classification`` (one label per sample) and ``causal_lm``
(next-token prediction); the data chooses (``DataBundle.task``) unless a task is named. Tasks
are found by name in :mod:`hpctrain.tasks.registry`; importing this package loads no torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from hpctrain.errors import UserError
from hpctrain.tasks.registry import task_class

if TYPE_CHECKING:
    from hpctrain.tasks.base import CrossEntropyTask, Task, select_keys
    from hpctrain.tasks.causal_lm import CausalLM, TokenMetrics
    from hpctrain.tasks.classification import Classification, masked_cross_entropy
    from hpctrain.tasks.loss import training_loss

__all__ = ["CausalLM", "Classification", "CrossEntropyTask", "Task", "TokenMetrics", "build_task",
           "masked_cross_entropy", "resolve_task", "select_keys", "training_loss"]

_LAZY = {"CrossEntropyTask": "base", "Task": "base", "select_keys": "base", "CausalLM": "causal_lm",
         "TokenMetrics": "causal_lm", "Classification": "classification", "masked_cross_entropy": "classification",
         "training_loss": "loss"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"hpctrain.tasks.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'hpctrain.tasks' has no attribute {name!r}")


def build_task(name: str) -> Task:
    """The task by name (``DataBundle.task``, or ``train.task``)."""
    return task_class(name)()


def resolve_task(name: str, data_task: str, data_name: str) -> Task:
    """``train.task`` against the data: ``auto`` takes the data's task; a named task must be
    the data's (token windows have no labels, labelled samples no next token)."""
    chosen = data_task if name == "auto" else name
    if chosen != data_task:
        raise UserError(f"train.task={name} does not fit data.name={data_name}, whose samples are for "
                        f"{data_task}; hint: train.task=auto (or {data_task})")
    return build_task(chosen)
