"""hpctrain: one PyTorch training job from a laptop CPU to a multi-node Slurm GPU cluster.

The parts (drop them into your own loop) and the reference trainer built from them.
"""

from hpctrain.config import Config, ConfigError, load_config
from hpctrain.data.memory import EvalLoader
from hpctrain.env import ClusterEnv, detect, init_distributed, teardown
from hpctrain.evaluate import evaluate
from hpctrain.metrics import Accuracy, ConfusionMatrix, EvalOutput, MeanLoss, Metric
from hpctrain.parallel import parallelize, unwrap
from hpctrain.precision import Precision

__version__ = "0.1.0"

__all__ = [
    "Accuracy", "ClusterEnv", "Config", "ConfigError", "ConfusionMatrix", "EvalLoader", "EvalOutput",
    "MeanLoss", "Metric", "Precision", "detect", "evaluate", "init_distributed", "load_config",
    "parallelize", "teardown", "unwrap",
]
