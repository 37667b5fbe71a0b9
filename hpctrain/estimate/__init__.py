"""Sizing estimator: FLOPs and wall time, memory per GPU by strategy, checkpoint cost, MTBF math.

The accelerator peak table (:mod:`hpctrain.estimate.hardware`) is shared with telemetry's MFU.
"""

from hpctrain.estimate.hardware import ACCELERATORS, Accelerator, lookup, peak_tflops
from hpctrain.estimate.memory import MemoryBreakdown, predict_rank_bytes
from hpctrain.estimate.model import TransformerShape
from hpctrain.estimate.plan import Inputs, estimate

__all__ = ["ACCELERATORS", "Accelerator", "Inputs", "MemoryBreakdown", "TransformerShape", "estimate", "lookup",
           "peak_tflops", "predict_rank_bytes"]
