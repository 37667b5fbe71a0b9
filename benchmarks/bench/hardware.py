"""What a benchmark ran on: CPU model and cores, GPUs, versions, and how busy the machine was.

The load average is part of the record because on a shared machine it, more than the
code, decides the absolute figures."""

from __future__ import annotations

import os
import socket
from typing import Any

from hpctrain.launch.doctor import cpus, gpus, versions
from hpctrain.telemetry.flops import cpu_name as cpu_model


def describe() -> dict[str, Any]:
    found = gpus()
    facts = versions()
    return {"host": socket.gethostname(), "cpu": cpu_model(), "cores": cpus(), "gpus": [g["name"] for g in found],
            "gpu_details": found, "torch": facts["torch"], "hpctrain": facts["hpctrain"],
            "python": facts["python"], "cuda_build": facts["cuda_build"], "load_avg_1m": os.getloadavg()[0]}


def one_line(hw: dict[str, Any]) -> str:
    """``AMD EPYC, 2 cores, no GPU, torch 2.13.0+cpu, load 1.1``: for the table and the plot."""
    gpu = ", ".join(hw["gpus"]) if hw["gpus"] else "no GPU"
    return (f"{hw['cpu']}, {hw['cores']} cores, {gpu}, torch {hw['torch']}, hpctrain {hw['hpctrain']}, "
            f"load {hw['load_avg_1m']:.1f}")
