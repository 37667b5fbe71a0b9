"""The trained weights, out of every strategy: ``RUN_DIR/model.pt`` streamed one tensor at a
time (:mod:`~hpctrain.weights.model`), the stream writer and ``hpctrain ckpt export``'s sources
(:mod:`~hpctrain.weights.export`), reading a weights file checked first (:mod:`~hpctrain.weights.load`),
where a user points at checkpoints (:mod:`~hpctrain.weights.locate`), frozen-base (LoRA) checkpoints
(:mod:`~hpctrain.weights.frozen`) and their PEFT exports (:mod:`~hpctrain.weights.adapters`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hpctrain.weights.model import save_model_streamed

__all__ = ["save_model_streamed"]


def __getattr__(name: str) -> Any:  # lazy: importing the package loads no torch
    if name == "save_model_streamed":
        from hpctrain.weights.model import save_model_streamed as saver  # torch: on first use only

        return saver
    raise AttributeError(f"module 'hpctrain.weights' has no attribute {name!r}")
