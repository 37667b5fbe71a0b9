"""What is being trained: the transformer shape and its parameter count live with the models
(:mod:`hpctrain.models.shape`, a component); this module keeps the estimator's names for it."""

from __future__ import annotations

from hpctrain.models.shape import (
    BIASES,
    MLPS,
    NORMS,
    POSITIONS,
    TransformerShape,
    count_params,
    llama_ffn,
    stage_layers,
    stage_params,
)

__all__ = ["BIASES", "MLPS", "NORMS", "POSITIONS", "TransformerShape", "count_params", "llama_ffn", "stage_layers",
           "stage_params"]
