"""torch.profiler over a window of steps: a chrome trace per selected rank and the top ops."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hpctrain.core.errors import UserError
from hpctrain.telemetry.profiler import StepProfiler


def _train(prof: StepProfiler, steps: int, first_step: int = 0) -> list[int]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 32), torch.randint(0, 4, (16,))
    profiled = []
    with prof:
        for step in range(first_step, first_step + steps):
            with torch.profiler.record_function(f"train_step_{step}"):
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()
            prof.step()
            profiled.append(step)
    return profiled


def _steps_in_trace(path) -> set[int]:
    events = json.loads(path.read_text())["traceEvents"]
    return {int(e["name"].rsplit("_", 1)[1]) for e in events if str(e.get("name", "")).startswith("train_step_")}


def test_window_writes_a_chrome_trace_and_top_ops(tmp_path):
    prof = StepProfiler(tmp_path / "profile", rank=0, start=3, count=2)
    _train(prof, steps=8)
    trace = tmp_path / "profile" / "rank0.pt.trace.json"
    assert prof.trace_path == trace
    assert _steps_in_trace(trace) == {3, 4}  # exactly the window: no warm-up step, nothing after
    assert len(prof.top_ops) == 10
    assert any("addmm" in op["name"] or "mm" in op["name"] for op in prof.top_ops)
    self_times = [op["self_cpu_ms"] for op in prof.top_ops]
    assert self_times == sorted(self_times, reverse=True)
    saved = json.loads((tmp_path / "profile" / "rank0.top_ops.json").read_text())
    assert [op["name"] for op in saved] == [op["name"] for op in prof.top_ops]


def test_window_counts_global_steps_after_a_resume(tmp_path):
    prof = StepProfiler(tmp_path, rank=0, start=12, count=1, first_step=10)
    _train(prof, steps=4, first_step=10)
    assert _steps_in_trace(tmp_path / "rank0.pt.trace.json") == {12}


def test_unselected_rank_and_past_window_do_nothing(tmp_path):
    assert not StepProfiler(tmp_path, rank=1, start=0, count=2, ranks=[0]).active
    past = StepProfiler(tmp_path, rank=0, start=2, count=2, first_step=5)
    assert not past.active
    _train(past, steps=2, first_step=5)
    assert not list(tmp_path.iterdir())


def test_bad_window_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="profile_steps"):
        StepProfiler(tmp_path, rank=0, start=1, count=0)
