"""Alias for users' code: the metrics are :mod:`hpctrain.tasks.metrics` (a task chooses its
metrics, and the evaluation loop only runs them). ``from hpctrain.evaluation.metrics import
Metric`` keeps working for one release; hpctrain's own modules import the new name."""

from hpctrain.tasks.metrics import (
    Accuracy,
    ConfusionMatrix,
    EvalOutput,
    MeanLoss,
    Metric,
    MultilabelMetrics,
    RegressionMetrics,
    default_metrics,
    user_metrics,
)

__all__ = ["Accuracy", "ConfusionMatrix", "EvalOutput", "MeanLoss", "Metric", "MultilabelMetrics",
           "RegressionMetrics", "default_metrics", "user_metrics"]
