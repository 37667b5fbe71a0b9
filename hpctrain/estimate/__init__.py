"""Sizing estimator: FLOPs and wall time, memory per GPU by strategy, checkpoint cost, MTBF math.

The accelerator peak table (:mod:`hpctrain.telemetry.accelerators`) is shared with telemetry's MFU, and
the meta-device measurement of a built model (:mod:`hpctrain.telemetry.measure`) with the planner and telemetry.
"""

from hpctrain.estimate.gpu_memory import MemoryBreakdown, predict_rank_bytes
from hpctrain.estimate.sizing import Inputs, estimate
from hpctrain.models.shape import TransformerShape
from hpctrain.telemetry.accelerators import ACCELERATORS, Accelerator, lookup, peak_tflops

__all__ = ["ACCELERATORS", "Accelerator", "Inputs", "MemoryBreakdown", "TransformerShape", "estimate", "lookup",
           "peak_tflops", "predict_rank_bytes"]
