"""The instruments of one training run, built from ``cfg.telemetry`` and held by the loop as
one object: the meter, the metric loggers, the straggler detector and its schedule, and the
profiler window. The loop calls :meth:`Telemetry.after_step` after every optimizer step."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from hpctrain.config.telemetry import TelemetryConfig
from hpctrain.core.env import ClusterEnv
from hpctrain.telemetry.flops import peak_flops
from hpctrain.telemetry.loggers import LoggerOptions, Loggers, build_loggers
from hpctrain.telemetry.memory_breakdown import MemoryProbe
from hpctrain.telemetry.meter import Meter
from hpctrain.telemetry.profiler import StepProfiler
from hpctrain.telemetry.stragglers import StragglerDetector, StragglerReport, StragglerSchedule

log = logging.getLogger("hpctrain")


class BatchShape(Protocol):
    """The run layout's batch fields the meter needs (hpctrain.planning.layout.RunLayout has them)."""

    @property
    def global_batch(self) -> int: ...
    @property
    def grad_accum(self) -> int: ...
    @property
    def dp(self) -> int: ...
    @property
    def flops_divisor(self) -> int: ...


@dataclass
class Telemetry:
    meter: Meter
    loggers: Loggers = field(default_factory=lambda: Loggers([]))
    detector: StragglerDetector | None = None
    schedule: StragglerSchedule | None = None
    profiler: StepProfiler | None = None
    reports: list[StragglerReport] = field(default_factory=list)
    memory: MemoryProbe = field(default_factory=MemoryProbe)  # armed by the loop: the first step's breakdown

    @classmethod
    def build(cls, t: TelemetryConfig, env: ClusterEnv, device: torch.device, step: int, *, batch: BatchShape,
              precision: str = "fp32", log_every: int = 1, run_dir: Path | None = None,
              run_config: dict[str, Any] | None = None) -> Telemetry:
        """Every rank (the straggler detector gathers host names once). Without ``run_dir``:
        measurement only, no loggers and no profiler (parts used in a user's own loop).
        ``batch``: the run's layout (hpctrain.planning.layout.RunLayout) or any object with its batch
        fields; ``run_config``: the whole config, for the loggers' run parameters."""
        meter = Meter(batch.global_batch, step, device, batch.grad_accum, batch.dp,
                      peak=peak_flops(device, precision, t.peak_tflops), sync_timing=t.sync_timing,
                      flops_divisor=batch.flops_divisor)
        out = cls(meter)
        if env.world_size > 1 and t.straggler_every_steps != 0:
            out.detector = StragglerDetector(t.straggler_threshold)
            out.schedule = StragglerSchedule(t.straggler_every_steps, step, log_every)
        if run_dir is not None:
            options = LoggerOptions(run_name=run_dir.name, experiment=t.experiment, mlflow_uri=t.mlflow_uri,
                                    wandb_mode=t.wandb_mode, config=dict(run_config or {}))
            out.loggers = build_loggers(t.loggers, run_dir, options, is_main=env.is_main)
            if t.profile_steps:
                out.profiler = StepProfiler(run_dir / "profile", env.rank, *t.profile_steps, first_step=step,
                                            ranks=t.profile_ranks, device=device)
        return out

    def start(self, step: int) -> None:
        """Right before the loop: the meter's clock starts now, the profiler's schedule too."""
        self.meter.restart(step)
        if self.profiler is not None:
            self.profiler.__enter__()

    def after_step(self, step: int) -> None:
        """After every optimizer step, on every rank: the profiler's schedule, and the
        straggler gather when due (one small all-gather; the same steps on every rank)."""
        if self.profiler is not None:
            self.profiler.step()
        if self.memory.pending:  # until gathered (the first step): one all-gather of 4 numbers
            self.memory.after_step()
        if self.schedule is not None and self.detector is not None and self.schedule.due(step):
            report = self.detector.gather(step, *self.meter.straggler_times(step))
            self.schedule.done(step, report)
            self.reports.append(report)
            self.loggers.log(report.to_row())

    def stop(self) -> None:
        """After the loop: the profiler writes its trace (also for a window cut short)."""
        self.memory.disarm()
        self.meter.finishing()
        if self.profiler is not None:
            self.profiler.__exit__(None, None, None)

    def close(self) -> None:
        self.stop()
        self.loggers.close()

    def summary(self, step: int) -> dict[str, Any]:
        """The run's means, the stragglers named, and (rank 0 profiled) the top-10 ops."""
        out = self.meter.summary(step) | self.memory.summary()
        if self.reports:
            out["straggler_max_imbalance"] = max(r.imbalance for r in self.reports)
            out["stragglers"] = sorted({rank for r in self.reports for rank in r.stragglers})
        if self.profiler is not None and self.profiler.top_ops:
            out["profile_top_ops"] = [op["name"] for op in self.profiler.top_ops]
        return out
