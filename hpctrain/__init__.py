"""hpctrain: one PyTorch training job from a laptop CPU to a multi-node Slurm GPU cluster.

The parts (drop them into your own loop) and the reference trainer built from them.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from hpctrain._version import __version__ as __version__

if TYPE_CHECKING:  # the same names as _EXPORTS, for type checkers (tests/test_imports.py compares them)
    from hpctrain.checkpoint.checkpointer import Checkpointer
    from hpctrain.checkpoint.state import Counters
    from hpctrain.config import Config, ConfigError, load_config
    from hpctrain.config.checkpoint import CheckpointConfig
    from hpctrain.config.parallel import ParallelConfig
    from hpctrain.core.env import ClusterEnv, detect, distributed, init_distributed, teardown
    from hpctrain.core.errors import EXIT_PREEMPTED
    from hpctrain.data.in_memory import EvalLoader, MemoryLoader
    from hpctrain.data.sampler import EvalSampler, ResumableSampler
    from hpctrain.evaluation.evaluate import evaluate, evaluate_dataset, sum_over_ranks
    from hpctrain.parallel import parallelize, strategy_for, unwrap
    from hpctrain.parallel.loop_checkpoint import LoopCheckpoint
    from hpctrain.precision import Precision
    from hpctrain.tasks.metrics import Accuracy, ConfusionMatrix, EvalOutput, MeanLoss, Metric
    from hpctrain.telemetry.meter import Meter
    from hpctrain.weights.digest import params_sha256

# Each public name and the module it lives in, imported on first use (PEP 562): every
# `hpctrain ...` command and every `import hpctrain.x` runs this file first, and most need
# neither torch nor the parts below. A loop of your own needs nothing else (examples/own_loop.py).
_EXPORTS = {
    # the job: environment, process group, config sections
    **dict.fromkeys(("ClusterEnv", "detect", "distributed", "init_distributed", "teardown"), "hpctrain.core.env"),
    **dict.fromkeys(("Config", "ConfigError", "load_config"), "hpctrain.config"),
    "ParallelConfig": "hpctrain.config.parallel",
    "CheckpointConfig": "hpctrain.config.checkpoint",
    # the parts of a loop: strategy, data, precision, checkpoints, meter, evaluation
    **dict.fromkeys(("parallelize", "strategy_for", "unwrap"), "hpctrain.parallel"),
    **dict.fromkeys(("EvalLoader", "MemoryLoader"), "hpctrain.data.in_memory"),
    **dict.fromkeys(("EvalSampler", "ResumableSampler"), "hpctrain.data.sampler"),
    "Precision": "hpctrain.precision",
    "Checkpointer": "hpctrain.checkpoint.checkpointer",
    "Counters": "hpctrain.checkpoint.state",
    "EXIT_PREEMPTED": "hpctrain.core.errors",
    "LoopCheckpoint": "hpctrain.parallel.loop_checkpoint",
    "Meter": "hpctrain.telemetry.meter",
    **dict.fromkeys(("evaluate", "evaluate_dataset", "sum_over_ranks"), "hpctrain.evaluation.evaluate"),
    **dict.fromkeys(("Accuracy", "ConfusionMatrix", "EvalOutput", "MeanLoss", "Metric"),
                    "hpctrain.tasks.metrics"),
    "params_sha256": "hpctrain.weights.digest",
}

__all__ = [
    "EXIT_PREEMPTED", "Accuracy", "CheckpointConfig", "Checkpointer", "ClusterEnv", "Config", "ConfigError",
    "ConfusionMatrix", "Counters", "EvalLoader", "EvalOutput", "EvalSampler", "LoopCheckpoint", "MeanLoss",
    "MemoryLoader", "Meter", "Metric", "ParallelConfig", "Precision", "ResumableSampler", "detect", "distributed",
    "evaluate", "evaluate_dataset", "init_distributed", "load_config", "params_sha256", "parallelize",
    "strategy_for", "sum_over_ranks", "teardown", "unwrap",
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
