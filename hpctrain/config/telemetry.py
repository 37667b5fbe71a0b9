"""The ``telemetry`` config section: what the training loop measures and where it logs."""

from __future__ import annotations

from dataclasses import dataclass

from hpctrain.core.section import ConfigError, opt, positive

LOGGERS = ("jsonl", "tensorboard", "mlflow", "wandb")


@dataclass(frozen=True, kw_only=True)
class TelemetryConfig:
    loggers: list[str] = opt(["jsonl"], "Metric sinks, any subset of jsonl, tensorboard, mlflow, wandb (jsonl, RUN_DIR/metrics.jsonl, is always on). Rank 0 logs; a missing package fails at start with the install hint, a sink failing later warns once and is dropped.")
    experiment: str = opt("hpctrain", "MLflow experiment and W&B project name.")
    mlflow_uri: str | None = opt(None, "MLflow tracking URI; default $MLFLOW_TRACKING_URI, else the local store ./mlruns/mlflow.db.")
    wandb_mode: str = opt("offline", "W&B mode: offline (files under RUN_DIR/wandb, `wandb sync` uploads), online (needs an API key) or disabled.")
    peak_tflops: float | None = opt(None, "The device's peak TFLOP/s for MFU; default: the accelerator table (A100, H100, H200, MI300X) on GPUs, a cached matmul probe on CPU.")
    sync_timing: bool = opt(False, "GPU only: synchronise the device at every phase boundary, so forward+backward and the optimizer step are timed on the device; costs throughput. Off: phases are host times (device work shows where the host waits).")
    straggler_every_steps: int | None = opt(None, "Gather per-rank times and score stragglers every N optimizer steps (one small all-gather); default (None): first at the first log row, then about once a minute from the measured step time; 0 = never.", none_text=("auto",))
    straggler_threshold: float = opt(1.2, "Name a rank a straggler (and warn) when its own work per step (data wait + compute) exceeds this x the median rank's.")
    profile_steps: list[int] = opt([], "[start, count]: run torch.profiler over optimizer steps start..start+count-1 and write a chrome trace per rank to RUN_DIR/profile/; [] = off.")
    profile_ranks: list[int] | None = opt(None, "Ranks to profile (default: every rank).")

    def __post_init__(self) -> None:
        unknown = [name for name in self.loggers if name not in LOGGERS]
        if unknown:
            raise ConfigError(f"telemetry.loggers={self.loggers}: unknown {unknown}; choose from {', '.join(LOGGERS)}")
        if self.wandb_mode not in ("offline", "online", "disabled"):
            raise ConfigError(f"telemetry.wandb_mode={self.wandb_mode!r}; choose one of: offline, online, disabled")
        positive("telemetry", self, "peak_tflops")
        if self.straggler_every_steps is not None and self.straggler_every_steps < 0:
            raise ConfigError(f"telemetry.straggler_every_steps={self.straggler_every_steps} must be >= 0 "
                              "(0 = never, empty = about once a minute)")
        if self.straggler_threshold < 1.0:
            raise ConfigError(f"telemetry.straggler_threshold={self.straggler_threshold} must be >= 1.0 "
                              "(it compares slowest / median); hint: 1.2 warns at 20% slower than the median")
        if self.profile_steps and (len(self.profile_steps) != 2 or self.profile_steps[0] < 0
                                   or self.profile_steps[1] < 1):
            raise ConfigError(f"telemetry.profile_steps={self.profile_steps} must be [start, count] with start >= 0 "
                              "and count >= 1; hint: [10, 3] profiles optimizer steps 10, 11 and 12")
