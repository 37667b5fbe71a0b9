"""One benchmark run in fresh child processes: ``hpctrain train`` itself (through
:mod:`bench.child`) or the hand-written loop (:mod:`bench.plain_ddp`), on
1..N ranks started by torchrun (``torch.distributed.run``), as ``hpctrain run`` does.

Fresh processes because peak memory is a per-process figure (the peak RSS of a process
never goes down, and CUDA's peak is per process too), and because a rank count other than
one needs its own processes anyway.

Throughput is the steady state: a run takes ``warmup + measured`` optimizer steps and logs
a metrics row every ``warmup`` steps, and the rate counts only the rows after the first
(the warm-up: allocator, first-touch, worker start-up). Each row's interval ends with the
logged loss read back to the host, a device sync, so the time is the device's too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpctrain.core.errors import RunError
from hpctrain.telemetry.runs import load_run

# The same optimizer and no schedule for every run, so that a case compares only what it varies;
# no checkpoints, no progress bar, no validation beyond the final (small) one outside the timing.
BASE_OVERRIDES = ("checkpoint.enabled=false", "train.progress=false", "train.eval_each_epoch=false",
                  "run.overwrite=true", "seed=0", "optim.name=sgd", "optim.lr=0.01", "optim.momentum=0.9",
                  "optim.schedule=constant")
# A bench started inside a job must not hand its own rank to the runs it starts.
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
                 "SLURM_PROCID", "SLURM_STEP_ID", "SLURM_STEPID")


@dataclass(frozen=True)
class Steps:
    """``warmup`` steps not counted, then ``measured`` steps (a multiple of ``warmup``)."""

    warmup: int
    measured: int

    def __post_init__(self) -> None:
        if self.warmup < 1 or self.measured < self.warmup or self.measured % self.warmup:
            raise ValueError(f"measured steps ({self.measured}) must be a positive multiple of warmup ({self.warmup})")

    @property
    def total(self) -> int:
        return self.warmup + self.measured


@dataclass(frozen=True)
class RunStats:
    samples_per_s: float
    peak_mem_gb: float         # max over ranks
    mem_kind: str              # cuda_max_allocated | peak_rss
    data_wait_share: float | None = None
    summary: dict[str, Any] | None = None


def child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS and not k.startswith("TORCHELASTIC_")}
    here = Path(__file__).resolve().parents
    # the children import this very bench package (benchmarks/) and the checkout's hpctrain (its root)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(here[1]), str(here[2]), env.get("PYTHONPATH")) if p)
    return env


def command(procs: int, module: str, args: list[str], torchrun: bool) -> list[str]:
    if not torchrun:
        return [sys.executable, "-m", module, *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}",
            "--monitor-interval=0.1", "-m", module, *args]


def launch(cmd: list[str], log: Path) -> None:
    """Run to the end; a failure raises RunError with the end of the child's output."""
    with open(log, "w") as fh:
        code = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=child_env(), check=False).returncode
    if code != 0:
        lines = log.read_text(errors="replace").splitlines()
        # torchrun ends with its own summary of the failure; the cause is the rank's last error line
        causes = [line for line in lines if "Error" in line and "ChildFailedError" not in line][-3:]
        shown = "\n".join([*causes, "...", *lines[-6:]])
        raise RunError(f"benchmark run failed (exit {code}): {' '.join(cmd)}\n{shown}\n(full output: {log})")


def rank_reports(prefix: Path) -> list[dict[str, Any]]:
    """The per-rank JSON files ``PREFIX.rankN.json`` the children wrote."""
    found = sorted(prefix.parent.glob(f"{prefix.name}.rank*.json"))
    if not found:
        raise RunError(f"benchmark run wrote no {prefix.name}.rank*.json in {prefix.parent}")
    return [json.loads(p.read_text()) for p in found]


def steady(rows: list[dict[str, Any]], key: str) -> float:
    """``key``'s mean over the intervals after the first, weighted by their steps; for a rate
    (per second) weighted by time instead: total samples over total seconds."""
    points = [(r["step"], float(r[key])) for r in rows if isinstance(r.get(key), (int, float))]
    if len(points) < 2:
        raise RunError(f"a benchmark run logged {len(points)} row(s) with {key}; it needs 2 or more")
    spans = [(step - prev, value) for (prev, _), (step, value) in zip(points, points[1:])]
    if key.endswith("_per_s"):
        return sum(n for n, _ in spans) / sum(n / v for n, v in spans)
    return sum(n * v for n, v in spans) / sum(n for n, _ in spans)


def hpctrain_run(work: Path, name: str, overrides: list[str], steps: Steps, procs: int = 1) -> RunStats:
    """``hpctrain train`` with ``overrides`` on ``procs`` ranks (under torchrun when more than
    one, as ``hpctrain run`` starts them); run directory ``work/name``."""
    run_dir, prefix = work / name, work / f"{name}.report"
    cfg = [*BASE_OVERRIDES, f"run.dir={run_dir}", f"train.max_steps={steps.total}", f"train.log_every={steps.warmup}",
           *overrides]
    launch(command(procs, "bench.child", [str(prefix), *cfg], procs > 1), work / f"{name}.log")
    ranks = rank_reports(prefix)
    main = next(r for r in ranks if r["rank"] == 0)
    rows = load_run(run_dir).train  # rank 0 writes the rows: global batch over rank 0's clock
    waits = [r for r in rows if "data_wait_share" in r]
    return RunStats(samples_per_s=steady(rows, "samples_per_s"), peak_mem_gb=max(r["peak_mem_gb"] for r in ranks),
                    mem_kind=main["mem_kind"], data_wait_share=steady(waits, "data_wait_share") if waits else None,
                    summary=main["summary"])


def plain_run(work: Path, name: str, args: list[str], procs: int) -> RunStats:
    """The hand-written DDP loop (:mod:`bench.plain_ddp`) on ``procs`` ranks, started alike."""
    prefix = work / f"{name}.report"
    launch(command(procs, "bench.plain_ddp", ["--out", str(prefix), *args], procs > 1), work / f"{name}.log")
    ranks = rank_reports(prefix)
    main = next(r for r in ranks if r["rank"] == 0)
    return RunStats(samples_per_s=main["samples_per_s"], peak_mem_gb=max(r["peak_mem_gb"] for r in ranks),
                    mem_kind=main["mem_kind"])
