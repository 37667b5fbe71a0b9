"""Checkpoint cost and failure rate: how often to save (Young 1974, Daly 2006).

Failures of independent GPUs add up: a cluster of n GPUs, each failing on average once
every M hours, fails once every M/n hours. Young's first-order optimum saves every
sqrt(2 · δ · M_cluster) for a save taking δ; the fraction of time lost is then about
δ/τ (saving) + τ/(2·M_cluster) (half an interval of work redone per failure).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hpctrain.core.errors import UserError


@dataclass(frozen=True)
class FailurePreset:
    """A published failure log: ``failures`` interruptions of a job of ``gpus`` GPUs over
    ``hours`` of wall time. Per-GPU MTBF = gpus x hours / failures (independent failures)."""

    name: str
    gpus: int
    hours: float
    failures: float
    source: str

    @property
    def gpu_mtbf_hours(self) -> float:
        return self.gpus * self.hours / self.failures


FAILURE_PRESETS = {p.name: p for p in (
    # Kokolis et al. 2024, "Revisiting Reliability in Large-Scale Machine Learning Research Clusters":
    # 7.9 h mean time to failure for a 1,024-GPU job on Meta's multi-tenant research clusters
    FailurePreset("kokolis-2024", 1024, 7.9, 1, "Kokolis et al. 2024: 7.9 h MTTF of 1,024-GPU jobs"),
    # Dubey et al. 2024 (Llama 3), table 5: 419 unexpected interruptions in 54 days on 16,384 H100s
    FailurePreset("llama3-405b", 16_384, 54 * 24, 419, "Dubey et al. 2024: 419 interruptions, 54 days, "
                                                       "16,384 GPUs"),
    # Zhang et al. 2022 (OPT): over 100 hosts (8 GPUs each) cycled in about 2 months
    # on 992 A100s; each cycled host is counted as one failure, 2 months as 60 days
    FailurePreset("opt-175b", 992, 60 * 24, 100, "Zhang et al. 2022: >100 hosts cycled, ~2 months, "
                                                 "992 GPUs"),
    # BigScience, "The Technology Behind BLOOM Training" (2022): 1-2 GPU failures a week on
    # 384 A100s; the midpoint, 1.5 a week
    FailurePreset("bloom-176b", 384, 7 * 24, 1.5, "BigScience 2022: 1-2 GPU failures a week, "
                                                  "384 GPUs"),
)}
# A shared Slurm cluster is what Kokolis et al. measured (research jobs of every size on
# multi-tenant clusters, every cause of failure a job sees); Llama 3's run had a dedicated,
# burned-in fleet and is 6x more optimistic.
DEFAULT_FAILURE_PRESET = "kokolis-2024"
DEFAULT_GPU_MTBF_HOURS = FAILURE_PRESETS[DEFAULT_FAILURE_PRESET].gpu_mtbf_hours  # 8,089.6 h


def failure_preset(name: str) -> FailurePreset:
    if name not in FAILURE_PRESETS:
        raise UserError(f"--failure-preset {name!r} is not one of {', '.join(FAILURE_PRESETS)}; "
                        "or give --mtbf-hours (per GPU)")
    return FAILURE_PRESETS[name]


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
