"""hpctrain: one PyTorch training job from a laptop CPU to a multi-node Slurm GPU cluster.

The parts (drop them into your own loop) and the reference trainer built from them.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from hpctrain._version import __version__ as __version__

if TYPE_CHECKING:  # the same names as _EXPORTS, for type checkers (tests/test_imports.py compares them)
    from hpctrain.checkpoint.loop import LoopCheckpoint
    from hpctrain.config import Config, ConfigError, load_config
    from hpctrain.core.env import ClusterEnv, detect, init_distributed, teardown
    from hpctrain.data.memory import EvalLoader
    from hpctrain.data.sampler import EvalSampler, ResumableSampler
    from hpctrain.evaluation.evaluate import evaluate, evaluate_dataset, sum_over_ranks
    from hpctrain.evaluation.metrics import Accuracy, ConfusionMatrix, EvalOutput, MeanLoss, Metric
    from hpctrain.parallel import parallelize, unwrap
    from hpctrain.precision import Precision

# Each public name and the module it lives in, imported on first use (PEP 562): every
# `hpctrain ...` command and every `import hpctrain.x` runs this file first, and most need
# neither torch nor the parts below.
_EXPORTS = {
    **dict.fromkeys(("Config", "ConfigError", "load_config"), "hpctrain.config"),
    "EvalLoader": "hpctrain.data.memory",
    **dict.fromkeys(("ClusterEnv", "detect", "init_distributed", "teardown"), "hpctrain.core.env"),
    **dict.fromkeys(("evaluate", "evaluate_dataset", "sum_over_ranks"), "hpctrain.evaluation.evaluate"),
    "LoopCheckpoint": "hpctrain.checkpoint.loop",
    **dict.fromkeys(("EvalSampler", "ResumableSampler"), "hpctrain.data.sampler"),
    **dict.fromkeys(("Accuracy", "ConfusionMatrix", "EvalOutput", "MeanLoss", "Metric"),
                    "hpctrain.evaluation.metrics"),
    **dict.fromkeys(("parallelize", "unwrap"), "hpctrain.parallel"),
    "Precision": "hpctrain.precision",
}

__all__ = [
    "Accuracy", "ClusterEnv", "Config", "ConfigError", "ConfusionMatrix", "EvalLoader", "EvalOutput",
    "EvalSampler", "LoopCheckpoint", "MeanLoss", "Metric", "Precision", "ResumableSampler", "detect",
    "evaluate", "evaluate_dataset", "init_distributed", "load_config", "parallelize", "sum_over_ranks",
    "teardown", "unwrap",
]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f"{__name__}.{name}")  # `hpctrain.data.X` after a bare `import hpctrain`
    else:
        raise AttributeError(f"module 'hpctrain' has no attribute {name!r}")
    globals()[name] = value  # found directly from now on
    return value
