"""The meter: the step-time breakdown, MFU and memory in metrics rows and the summary; the
straggler schedule; the telemetry config section. Behaviour only, never timings."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hpctrain.config import ConfigError, load_config
from hpctrain.core.env import ClusterEnv
from hpctrain.telemetry.flops import Peak
from hpctrain.telemetry.meter import BACKWARD, CKPT, DATA, EVAL, FORWARD, OPTIM, OTHER, Meter
from hpctrain.telemetry.runs import BREAKDOWN
from hpctrain.telemetry.stragglers import RankScore, StragglerReport, StragglerSchedule
from hpctrain.train import build_components, fit, load_data, train

CPU = torch.device("cpu")
BASE = ["model.name=tests.user_models:tiny_mlp", "data.name=synthetic_tiny", "data.synthetic_size=256",
        "data.batch_size=16", "train.progress=false", "train.log_every=4", "data.max_val_samples=32",
        "train.threads=1"]


@pytest.fixture(autouse=True)
def _probe_cache_in_tmp(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU peak probe caches under $XDG_CACHE_HOME: keep it out of the home directory."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.getbasetemp() / "cache"))


@dataclass
class _TokenBatch:
    inputs: torch.Tensor
    num_tokens: int


class _Clock:
    """perf_counter for the meter, moved by hand: each phase takes exactly the seconds given."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def spend(self, meter: Meter, phase: int, seconds: float) -> None:
        self.now += seconds
        meter.lap(phase)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    import hpctrain.telemetry.meter as meter_module

    fake = _Clock()
    monkeypatch.setattr(meter_module, "time", SimpleNamespace(perf_counter=fake))
    return fake


def test_laps_fill_the_breakdown_and_mfu_of_a_row(clock: _Clock):
    meter = Meter(global_batch=8, step=0, grad_accum=2, world_size=2, peak=Peak(72.0, "test"))
    model = torch.nn.Linear(4, 3)
    clock.now += 0.5  # set-up inside the first step: counted as other
    meter.first_batch(model, _TokenBatch(torch.randn(2, 4), num_tokens=10))
    assert meter.step_flops == 3 * 2 * 2 * 4 * 3 * 2  # 3 x forward (2 FLOPs per MAC) x 2 micro-batches = 288
    assert meter.tokens_per_step == 10 * 2 * 2
    for phase, seconds in ((DATA, 0.5), (FORWARD, 1.0), (BACKWARD, 2.0),  # two micro-batches, then the step
                           (DATA, 0.25), (FORWARD, 1.0), (BACKWARD, 2.0), (OPTIM, 0.75)):
        clock.spend(meter, phase, seconds)
    row = meter.interval(1)  # one optimizer step in 8 s of wall time
    assert set(BREAKDOWN) <= set(row)
    assert {k: row[k] for k in BREAKDOWN} == {"time_data_s": 0.75, "time_fwd_bwd_s": 6.0, "time_optim_s": 0.75,
                                              "time_ckpt_s": 0.0, "time_eval_s": 0.0, "time_other_s": 0.5}
    assert row["samples_per_s"] == 8 / 8 and row["tokens_per_s"] == 40 / 8
    assert row["data_wait_share"] == 0.75 / 8
    assert row["mfu"] == pytest.approx(288 / 8 / 72.0)  # 36 FLOP/s achieved of 72: 0.5
    assert row["mem_peak_gb"] > 0
    assert meter.straggler_times(1) == (8.0, 0.75, 2.0)  # step, data wait, own forward (no backward, no optim)
    assert meter.data_wait_seconds == 0.75


def test_windows_are_independent_and_the_summary_covers_the_run(clock: _Clock):
    meter = Meter(global_batch=4, step=10)
    clock.spend(meter, FORWARD, 2.0)
    first = meter.interval(11)
    for phase, seconds in ((EVAL, 3.0), (CKPT, 0.5), (DATA, 0.25), (OTHER, 0.25)):
        clock.spend(meter, phase, seconds)
    second = meter.interval(12)
    assert {k: first[k] for k in BREAKDOWN} == {**dict.fromkeys(BREAKDOWN, 0.0), "time_fwd_bwd_s": 2.0}
    assert {k: second[k] for k in BREAKDOWN} == {**dict.fromkeys(BREAKDOWN, 0.0), "time_eval_s": 3.0,
                                                 "time_ckpt_s": 0.5, "time_data_s": 0.25, "time_other_s": 0.25}
    assert first["samples_per_s"] == 4 / 2 and second["samples_per_s"] == 4 / 4
    assert "mfu" not in first and "tokens_per_s" not in first  # no peak, no FLOPs: no MFU rather than a wrong one
    assert meter.straggler_times(12) == (3.0, 0.125, 1.0)  # its own window: both steps since the start
    summary = meter.summary(12)  # the whole run (2 steps: no warm-up left out) in 6 s, 3 of them validation
    assert {k: summary[k] for k in BREAKDOWN} == {"time_data_s": 0.125, "time_fwd_bwd_s": 1.0, "time_optim_s": 0.0,
                                                  "time_ckpt_s": 0.25, "time_eval_s": 1.5, "time_other_s": 0.125}
    assert summary["samples_per_s"] == 8 / 3 and summary["mem_peak_gb"] > 0  # over the training time
    clock.now += 4.0  # a log row now: steps 12..14 took 4 s of forward; the straggler window is its own
    clock.spend(meter, FORWARD, 0.0)
    assert meter.interval(14)["time_fwd_bwd_s"] == 2.0 and meter.straggler_times(14) == (2.0, 0.0, 2.0)


def test_the_summary_leaves_the_first_steps_warm_up_out(clock: _Clock):
    """A compiled first step (20 s) then 3 steps of 1 s: the summary's rates are the steady state's,
    the warm-up is reported apart; a run of one step is measured whole."""
    meter = Meter(global_batch=4, step=0, peak=Peak(10.0, "test"))
    meter.step_flops = 5
    for seconds in (20.0, 1.0, 1.0, 1.0):
        clock.spend(meter, FORWARD, seconds - 0.5)
        clock.spend(meter, OPTIM, 0.5)
    meter.finishing()  # the loop is over: its window ends, the final validation and save are not in it
    clock.now += 50.0
    meter.finishing()  # once only
    summary = meter.summary(4)
    assert summary["warmup_s"] == 20.0
    assert summary["samples_per_s"] == 4 * 3 / 3.0 and summary["time_fwd_bwd_s"] == 0.5
    assert summary["mfu"] == pytest.approx(5 / 1.0 / 10.0)  # not 5 x 4 / 23 / 10
    one = Meter(global_batch=4, step=7)
    clock.spend(one, FORWARD, 20.0)
    clock.spend(one, OPTIM, 0.5)
    whole = one.summary(8)
    assert whole["warmup_s"] is None and whole["samples_per_s"] == 4 / 20.5


def test_a_resumed_runs_summary_rates_are_its_own_steps(tmp_path: Path):
    """A run continued from step 6 to 12: its samples/s is this process's 6 steps over their time
    (it was all 12 steps' samples over the last 6 steps' time, twice too fast). The phases add up
    to the wall time per step, so rate x (wall - validation) per step is one global batch."""
    run = [*BASE, f"run.dir={tmp_path / 'run'}", "train.eval_each_epoch=false"]
    train(load_config(None, [*run, "train.max_steps=6"]))
    summary = train(load_config(None, [*run, "train.max_steps=12"]))
    assert summary["steps"] == 12 and summary["samples_seen"] == 12 * 16
    training_per_step = sum(summary[k] for k in BREAKDOWN) - summary["time_eval_s"]
    assert summary["samples_per_s"] * training_per_step == pytest.approx(16, rel=1e-6)
    assert summary["warmup_s"] > 0


def test_a_model_the_counter_cannot_run_only_loses_its_mfu(caplog):
    class Broken(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("no")

    meter = Meter(global_batch=4, step=0, peak=Peak(1e12, "test"))
    meter.first_batch(Broken(), _TokenBatch(torch.randn(2, 4), 1))
    assert meter.step_flops is None and "MFU is not reported" in caplog.text
    assert "mfu" not in meter.interval(1)


def test_fit_rows_carry_the_breakdown_and_a_cpu_mfu_in_range():
    cfg = load_config(None, [*BASE, "train.max_steps=8", "train.eval_each_epoch=false"])
    env = ClusterEnv()
    parts = build_components(cfg, env, CPU, load_data(cfg, env, CPU, with_val=False))
    result = fit(cfg, env, CPU, parts)
    tel = result.telemetry
    assert 0 < tel["mfu"] <= 1 and tel["step_flops"] > 0 and tel["peak_tflops"] > 0
    assert "matmul probe" in tel["peak_source"]
    assert tel["time_fwd_bwd_s"] > 0 and tel["mem_peak_gb"] > 0
    assert 0 < tel["data_wait_share"] < 1


def test_train_writes_breakdown_mfu_and_memory_rows_and_summary(tmp_path: Path):
    run = tmp_path / "run"
    summary = train(load_config(None, [*BASE, f"run.dir={run}", "train.max_steps=8"]))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == [4, 8]
    for row in train_rows:
        assert set(BREAKDOWN) <= set(row) and 0 < row["mfu"] <= 1 and row["mem_peak_gb"] > 0
    assert 0 < summary["mfu"] <= 1 and summary["mem_peak_gb"] > 0 and summary["samples_per_s"] > 0
    assert all(summary[k] >= 0 for k in BREAKDOWN) and summary["eval_seconds"] > 0  # validation: timed apart
    assert "stragglers" not in summary  # one rank: nothing to compare


def test_peak_override_sets_the_mfu_denominator(tmp_path: Path):
    summary = train(load_config(None, [*BASE, f"run.dir={tmp_path / 'run'}", "train.max_steps=4",
                                       "telemetry.peak_tflops=1e-9"]))  # 1 kFLOP/s: MFU far above 1
    assert summary["peak_source"] == "telemetry.peak_tflops" and summary["mfu"] > 1


def _report(step: int, step_s: float) -> StragglerReport:
    return StragglerReport(step, 1.0, 1.2, [RankScore(0, "n", step_s, 0.0, step_s, 1.0, 1.0)])


def test_straggler_schedule_fixed_auto_and_off():
    fixed = StragglerSchedule(100, first_step=250, first_after=20)  # a resumed run: multiples of 100
    hits = []
    for step in range(250, 520):
        if fixed.due(step):
            hits.append(step)
            fixed.done(step, _report(step, 0.1))
    assert hits == [300, 400, 500]
    auto = StragglerSchedule(None, first_step=0, first_after=20)
    assert not auto.due(19) and auto.due(20)
    auto.done(20, _report(20, 0.5))  # 0.5 s per step: about once a minute = every 120 steps
    assert auto.next == 140
    auto.done(140, _report(140, 120.0))  # slower than a minute per step: every step
    assert auto.next == 141
    off = StragglerSchedule(0, first_step=0, first_after=20)
    assert not any(off.due(s) for s in range(1000))


@pytest.mark.parametrize("override, message", [
    ("telemetry.loggers=[jsonl,tensorbord]", "tensorbord"),
    ("telemetry.profile_steps=[5]", "start, count"),
    ("telemetry.profile_steps=[5,0]", "count >= 1"),
    ("telemetry.straggler_threshold=0.9", "straggler_threshold"),
    ("telemetry.straggler_every_steps=-1", "straggler_every_steps"),
    ("telemetry.wandb_mode=cloud", "wandb_mode"),
])
def test_bad_telemetry_config_names_the_key(override: str, message: str):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_straggler_every_steps_auto_reads_as_none():
    assert load_config(None, ["telemetry.straggler_every_steps=auto"]).telemetry.straggler_every_steps is None


def test_counting_flops_leaves_the_users_forward_hooks_silent():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    calls: list[str] = []
    model.register_forward_hook(lambda *_: calls.append("outer"))
    model[0].register_forward_pre_hook(lambda *_: calls.append("inner"))
    Meter(global_batch=2, step=0).first_batch(model, _TokenBatch(torch.randn(2, 4), 1))
    assert calls == []
    model(torch.randn(2, 4))
    assert calls == ["inner", "outer"]  # and they are back in place


def test_tokens_given_by_the_loop_win_and_no_tokens_means_no_column():
    meter = Meter(global_batch=4, step=0, grad_accum=3, world_size=2)
    meter.first_batch(torch.nn.Linear(4, 2), _TokenBatch(torch.randn(2, 4), num_tokens=99), tokens=7)
    assert meter.tokens_per_step == 7 * 3 * 2
    plain = Meter(global_batch=4, step=0)
    plain.first_batch(torch.nn.Linear(4, 2), type("B", (), {"inputs": torch.randn(2, 4)})())
    assert plain.tokens_per_step is None and "tokens_per_s" not in plain.interval(1)


def test_a_run_faster_than_a_disturbed_cpu_probe_remeasures_it(tmp_path, monkeypatch) -> None:
    """A probe taken on a busy node is too low; a later quiet run would report MFU > 1.
    The meter probes again and keeps the best, so MFU stays <= 1 and the cache improves."""
    from hpctrain.telemetry import flops

    monkeypatch.setenv("HPCTRAIN_CACHE", str(tmp_path))
    disturbed = flops.Peak(1e6, f"{flops.cpu_name()} torch.float32 matmul probe")  # 1 MFLOP/s: far too low
    fresh = flops.remeasure_cpu_peak(disturbed, achieved=5e6)
    assert fresh.flops > 5e6 and fresh.source.endswith("(re-measured)")
    assert flops.cpu_matmul_peak(cache_dir=tmp_path) == fresh.flops  # the cache now holds the better figure


def test_the_cpu_peak_probe_leaves_the_global_rng_alone(tmp_path) -> None:
    """The probe runs on a fresh machine inside the first training step: drawing from the
    global RNG there would change dropout masks, so a run would no longer equal a
    hand-written loop (seen on a fresh GPU node's CPU: weights differed)."""
    from hpctrain.telemetry import flops

    before = torch.get_rng_state()
    flops.cpu_matmul_peak(cache_dir=tmp_path)  # nothing cached here: it probes
    assert torch.equal(torch.get_rng_state(), before)
