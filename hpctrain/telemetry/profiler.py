"""``telemetry.profile_steps=[start, count]``: torch.profiler over a window of optimizer steps.

One chrome trace per profiled rank, ``RUN_DIR/profile/rank{R}.pt.trace.json`` (open it in
https://ui.perfetto.dev or chrome://tracing; the ``.pt.trace.json`` name is what the
TensorBoard profiler plugin looks for), plus ``rank{R}.top_ops.json``: the 10 ops with the
most self time. The profiler's own schedule does the windowing: skip steps before the
window, warm up for one step (the first profiled step otherwise carries set-up cost), then
record ``count`` steps.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from hpctrain.core.errors import UserError

TOP_OPS = 10


class StepProfiler:
    """Enter it around the loop and call :meth:`step` after every optimizer step. Outside
    the window, or on a rank not in ``ranks``, it does nothing at all."""

    def __init__(self, out_dir: Path, rank: int, start: int, count: int, *, first_step: int = 0,
                 ranks: Sequence[int] | None = None, device: torch.device | None = None, warmup: int = 1) -> None:
        if start < 0 or count < 1:
            raise UserError(f"telemetry.profile_steps=[{start}, {count}]: need start >= 0 and count >= 1; "
                            "hint: [10, 3] profiles optimizer steps 10, 11 and 12")
        self.out_dir, self.rank, self.device = out_dir, rank, device
        self.top_ops: list[dict[str, Any]] = []
        self.trace_path: Path | None = None
        ahead = start - first_step  # steps from here to the window (a resumed run starts later)
        selected = ranks is None or rank in ranks
        self._prof = self._build(ahead, count, warmup) if selected and ahead >= 0 else None

    def _build(self, ahead: int, count: int, warmup: int) -> profile:
        warm = min(warmup, ahead)
        activities = [ProfilerActivity.CPU]
        if self.device is not None and self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        return profile(activities=activities, schedule=schedule(skip_first=ahead - warm, wait=0, warmup=warm,
                                                                active=count, repeat=1),
                       on_trace_ready=self._on_trace_ready, record_shapes=False)

    @property
    def active(self) -> bool:
        return self._prof is not None

    def __enter__(self) -> StepProfiler:
        if self._prof is not None:
            self._prof.start()
        return self

    def step(self) -> None:
        if self._prof is not None:
            self._prof.step()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._prof is not None:
            self._prof.stop()  # a window cut short by the end of training is still written
            self._prof = None

    def _on_trace_ready(self, prof: profile) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.trace_path = self.out_dir / f"rank{self.rank}.pt.trace.json"
        prof.export_chrome_trace(str(self.trace_path))
        self.top_ops = top_ops(prof, device=self.device is not None and self.device.type == "cuda")
        (self.out_dir / f"rank{self.rank}.top_ops.json").write_text(json.dumps(self.top_ops, indent=2) + "\n")


def top_ops(prof: profile, n: int = TOP_OPS, device: bool = False) -> list[dict[str, Any]]:
    """The ``n`` ops with the most self time (device time on GPUs, CPU time otherwise)."""
    events = prof.key_averages()
    key = "self_device_time_total" if device else "self_cpu_time_total"
    ranked = sorted(events, key=lambda e: getattr(e, key, 0.0), reverse=True)[:n]
    return [{"name": e.key, "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3,
             "cpu_total_ms": e.cpu_time_total / 1e3, "self_device_ms": getattr(e, "self_device_time_total", 0.0) / 1e3}
            for e in ranked]
