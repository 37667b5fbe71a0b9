"""Tasks: what the loop trains for. ``classification`` (one label per sample) and ``causal_lm``
(next-token prediction); the data chooses (``DataBundle.task``) unless a task is named."""

from __future__ import annotations

from hpctrain.errors import UserError
from hpctrain.tasks.base import CrossEntropyTask, Task, select_keys
from hpctrain.tasks.causal_lm import CausalLM, TokenMetrics
from hpctrain.tasks.classification import Classification, masked_cross_entropy

__all__ = ["TASKS", "CausalLM", "Classification", "CrossEntropyTask", "Task", "TokenMetrics", "build_task",
           "masked_cross_entropy", "resolve_task", "select_keys"]

TASKS: dict[str, type[CrossEntropyTask]] = {"classification": Classification, "causal_lm": CausalLM}


def build_task(name: str) -> Task:
    """The task by name (``DataBundle.task``, or ``train.task``)."""
    if name not in TASKS:
        raise UserError(f"task {name!r} is unknown; choose one of: {', '.join(TASKS)}")
    return TASKS[name]()


def resolve_task(name: str, data_task: str, data_name: str) -> Task:
    """``train.task`` against the data: ``auto`` takes the data's task; a named task must be
    the data's (token windows have no labels, labelled samples no next token)."""
    chosen = data_task if name == "auto" else name
    if chosen != data_task:
        raise UserError(f"train.task={name} does not fit data.name={data_name}, whose samples are for "
                        f"{data_task}; hint: train.task=auto (or {data_task})")
    return build_task(chosen)
