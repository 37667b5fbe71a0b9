"""The accelerator peak table, under the estimator's name (documented, so users' code may import
it here): it lives with telemetry (:mod:`hpctrain.telemetry.accelerators`), which reads it for MFU."""

from hpctrain.telemetry.accelerators import ACCELERATORS, ALIASES, PRECISIONS, Accelerator, lookup, peak_tflops

__all__ = ["ACCELERATORS", "ALIASES", "PRECISIONS", "Accelerator", "lookup", "peak_tflops"]
