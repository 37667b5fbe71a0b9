"""Telemetry through the real loop (``train()`` / ``hpctrain run -n 2 train``): stragglers named
on gloo ranks, profiler traces, TensorBoard and MLflow read back, and ``hpctrain report``
on a finished 2-rank run. Behaviour only, never timings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hpctrain.config import load_config
from hpctrain.core.env import ClusterEnv
from hpctrain.train import train
from tests.dist_utils import launch_env, run_ranks

ROOT = Path(__file__).resolve().parents[2]
BASE = ["model.name=tests.user_models:tiny_mlp", "data.name=synthetic_tiny", "data.synthetic_size=256",
        "data.batch_size=16", "train.progress=false", "train.log_every=4", "data.max_val_samples=32",
        "train.threads=1", "train.max_steps=8"]
# Every rank sleeps 30 ms per training forward; $HPCTRAIN_TEST_SLOW_RANK sleeps 300 ms.
STRAGGLER = [*BASE, "model.name=tests.user_models:straggler_mlp", "telemetry.straggler_every_steps=4",
             "telemetry.straggler_threshold=1.5", "checkpoint.enabled=false"]


@pytest.fixture(autouse=True)
def _probe_cache_in_tmp(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU peak probe caches under $XDG_CACHE_HOME (spawned ranks inherit it)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.getbasetemp() / "cache"))


def _rows(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _train_as_rank(env: ClusterEnv, args: list[str]) -> dict[str, Any]:
    """train() as a torchrun rank would run it (the group exists already; train() reuses it)."""
    os.environ.update(RANK=str(env.rank), WORLD_SIZE=str(env.world_size), LOCAL_RANK=str(env.local_rank),
                      LOCAL_WORLD_SIZE=str(env.local_world_size))
    return train(load_config(None, args))


# ---------------------------------------------------------------- stragglers


def test_a_rank_slowed_by_a_sleep_is_named_the_straggler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("HPCTRAIN_TEST_SLOW_RANK", "1")
    run = tmp_path / "run"
    summaries = run_ranks(2, _train_as_rank, [*STRAGGLER, f"run.dir={run}"])
    rows = [r for r in _rows(run) if r.get("kind") == "straggler"]
    assert [r["step"] for r in rows] == [4, 8]  # the same steps on every rank, logged once by rank 0
    for row in rows:
        assert row["stragglers"] == [1] and row["imbalance"] > 1.5
        by_rank = {r["rank"]: r for r in row["ranks"]}
        assert set(by_rank) == {0, 1} and all(r["node"] for r in by_rank.values())
        assert by_rank[0]["relative"] == 1.0 and by_rank[1]["relative"] < 1.0
        assert all(0 < r["individual"] <= 1.0 for r in by_rank.values())
    assert summaries[0]["stragglers"] == [1] and summaries[1]["stragglers"] == [1]


def test_a_balanced_run_names_no_straggler_and_profiles_only_the_ranks_asked(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("HPCTRAIN_TEST_SLOW_RANK", raising=False)
    run = tmp_path / "run"
    summaries = run_ranks(2, _train_as_rank, [*STRAGGLER, f"run.dir={run}", "telemetry.profile_steps=[1,2]",
                                              "telemetry.profile_ranks=[1]"])
    rows = [r for r in _rows(run) if r.get("kind") == "straggler"]
    assert len(rows) == 2 and all(r["stragglers"] == [] for r in rows)
    assert summaries[0]["stragglers"] == []
    assert sorted(p.name for p in (run / "profile").iterdir()) == ["rank1.pt.trace.json", "rank1.top_ops.json"]
    assert "profile_top_ops" not in summaries[0] and summaries[1]["profile_top_ops"]  # rank 0 was not profiled


# ---------------------------------------------------------------- profiler and loggers


def test_profile_steps_write_a_trace_and_name_the_top_ops(tmp_path: Path):
    run = tmp_path / "run"
    summary = train(load_config(None, [*BASE, f"run.dir={run}", "telemetry.profile_steps=[2,3]"]))
    trace = json.loads((run / "profile" / "rank0.pt.trace.json").read_text())
    assert trace["traceEvents"]
    top = summary["profile_top_ops"]
    assert 0 < len(top) <= 10 and any("addmm" in name or "linear" in name for name in top)
    assert json.loads((run / "profile" / "rank0.top_ops.json").read_text())[0]["name"] == top[0]


def test_tensorboard_events_read_back_equal_the_jsonl_rows(tmp_path: Path):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    run = tmp_path / "run"
    train(load_config(None, [*BASE, f"run.dir={run}", "telemetry.loggers=[tensorboard]"]))
    acc = event_accumulator.EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"loss", "mfu", "time_fwd_bwd_s", "time_data_s", "mem_peak_gb", "val_accuracy"} <= tags
    loss = {r["step"]: r["loss"] for r in _rows(run) if "loss" in r}
    assert {e.step: e.value for e in acc.Scalars("loss")} == pytest.approx(loss, rel=1e-6)


def test_mlflow_run_read_back(tmp_path: Path):
    pytest.importorskip("mlflow")
    pytest.importorskip("sqlalchemy")
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run = tmp_path / "run"
    train(load_config(None, [*BASE, f"run.dir={run}", "telemetry.loggers=[mlflow]", f"telemetry.mlflow_uri={uri}",
                             "telemetry.experiment=loop-test"]))
    client = MlflowClient(uri)
    found = client.search_runs([client.get_experiment_by_name("loop-test").experiment_id])
    assert len(found) == 1 and found[0].info.run_name == "run" and found[0].info.status == "FINISHED"
    history = client.get_metric_history(found[0].info.run_id, "mfu")
    assert [m.step for m in history] == [4, 8] and all(0 < m.value <= 1 for m in history)
    assert found[0].data.params["train.max_steps"] == "8"


# ---------------------------------------------------------------- hpctrain report on a real 2-rank run


def _env() -> dict[str, str]:
    return launch_env(HPCTRAIN_TEST_SLOW_RANK="1")


def test_report_of_a_finished_two_rank_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    pytest.importorskip("matplotlib")
    from hpctrain.cli import main

    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "hpctrain", "run", "-n", "2", "train", *STRAGGLER, f"run.dir={run}",
           "telemetry.straggler_every_steps=2"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "stragglers rank 1" in proc.stdout + proc.stderr  # rank 0 warned
    assert main(["report", str(run)]) == 0
    pngs = {p.stem for p in (run / "report").glob("*.png")}
    assert {"step_time", "stragglers", "mfu", "memory", "throughput", "loss"} <= pngs
    report = (run / "report" / "report.md").read_text()
    assert "| run | 1 |" in report and "| 4/4 |" in report  # rank 1 named at all 4 gathers
    assert "mfu" in capsys.readouterr().out
