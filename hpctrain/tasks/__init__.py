"""Tasks: what the loop trains for. ``classification`` (one label per sample) and ``causal_lm``
(next-token prediction); the data chooses (``DataBundle.task``) unless a task is named."""

from __future__ import annotations

from hpctrain.errors import UserError
from hpctrain.tasks.base import CrossEntropyTask, Task, select_keys
from hpctrain.tasks.causal_lm import CausalLM, TokenMetrics
from hpctrain.tasks.classification import Classification, masked_cross_entropy

__all__ = ["TASKS", "CausalLM", "Classification", "CrossEntropyTask", "Task", "TokenMetrics", "build_task",
           "masked_cross_entropy", "select_keys"]

TASKS: dict[str, type[CrossEntropyTask]] = {"classification": Classification, "causal_lm": CausalLM}


def build_task(name: str) -> Task:
    """The task by name (``DataBundle.task``, or a ``train.task`` key once there is one)."""
    if name not in TASKS:
        raise UserError(f"task {name!r} is unknown; choose one of: {', '.join(TASKS)}")
    return TASKS[name]()
