"""Checkpoint cost and failure rate: how often to save (Young 1974, Daly 2006).

Failures of independent GPUs add up: a cluster of n GPUs, each failing on average once
every M hours, fails once every M/n hours. Young's first-order optimum saves every
sqrt(2 · δ · M_cluster) for a save taking δ; the fraction of time lost is then about
δ/τ (saving) + τ/(2·M_cluster) (half an interval of work redone per failure).
"""

from __future__ import annotations

import math

# Llama 3 (Dubey et al. 2024, table 5): 419 unexpected interruptions in 54 days on 16,384 H100s,
# i.e. 16,384 x 54 x 24 / 419 ~ 50,700 GPU-hours between failures.
DEFAULT_GPU_MTBF_HOURS = 50_000.0
DEFAULT_CKPT_GBPS = 10.0  # aggregate write bandwidth of a modest parallel file system


def write_seconds(size_bytes: float, bandwidth_bytes_per_s: float) -> float:
    return size_bytes / bandwidth_bytes_per_s


def cluster_mtbf_hours(gpu_mtbf_hours: float, gpus: int) -> float:
    return gpu_mtbf_hours / gpus


def young_daly_seconds(save_seconds: float, mtbf_seconds: float) -> float:
    return math.sqrt(2.0 * save_seconds * mtbf_seconds)


def overhead_fraction(save_seconds: float, interval_seconds: float, mtbf_seconds: float) -> float:
    """First-order share of wall time spent saving and redoing lost work."""
    return save_seconds / interval_seconds + interval_seconds / (2.0 * mtbf_seconds)
