"""A model factory for the real-Slurm tests that records what each rank was given: its CPU affinity,
the thread settings and Slurm's CPU variables, as one JSON file per rank start in
$HPCTRAIN_TEST_AFFINITY_DIR. The model is tests.user_models:slow_mlp (the same weights)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from torch import nn

from tests.user_models import slow_mlp


def slow_mlp_reporting(num_classes: int = 10) -> nn.Module:
    folder = os.environ.get("HPCTRAIN_TEST_AFFINITY_DIR")
    if folder:
        seen = {"rank": os.environ.get("RANK"), "pid": os.getpid(), "affinity": sorted(os.sched_getaffinity(0)),
                "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                "slurm_cpus_per_task": os.environ.get("SLURM_CPUS_PER_TASK"),
                "slurm_cpus_on_node": os.environ.get("SLURM_CPUS_ON_NODE"),  # in a step: the step's CPUs
                "restart": os.environ.get("SLURM_RESTART_COUNT", "0")}
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / f"rank{seen['rank']}-{os.getpid()}.json").write_text(json.dumps(seen))
    return slow_mlp(num_classes)
