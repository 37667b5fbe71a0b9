"""The tasks ``train.task`` can name, by import path: reading the names (the config check)
imports no torch. A new task is one module with a :class:`hpctrain.tasks.base.Task` subclass
and one line here (or :func:`register_task` from the user's own code)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from hpctrain.config.train import add_task_name
from hpctrain.core.errors import UserError

if TYPE_CHECKING:
    from hpctrain.tasks.base import Task

_TASKS: dict[str, str] = {
    "classification": "hpctrain.tasks.classification:Classification",
    "causal_lm": "hpctrain.tasks.causal_lm:CausalLM",
    "regression": "hpctrain.tasks.regression:Regression",
    "multilabel": "hpctrain.tasks.multilabel:Multilabel",
    "custom": "hpctrain.tasks.custom:Custom",
}
LABELLED = ("regression", "multilabel", "custom")  # tasks any labelled data fits (their targets say the rest)


def task_names() -> tuple[str, ...]:
    return tuple(_TASKS)


def register_task(name: str, target: str) -> None:
    """Make ``train.task=name`` (and data that asks for it) run the Task class at ``package.module:Class``."""
    _TASKS[name] = target
    add_task_name(name)


def task_class(name: str) -> type[Task]:
    target = _TASKS.get(name)
    if target is None:
        raise UserError(f"task {name!r} is unknown; choose one of: {', '.join(_TASKS)}")
    module, _, attr = target.partition(":")
    kind: type[Task] = getattr(importlib.import_module(module), attr)
    return kind
