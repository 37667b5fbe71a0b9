"""End to end on real MNIST through the CLI: one process, then eval at 3 ranks via `hpctrain run -n 3`
(2 training ranks on real MNIST under `hpctrain run -n 2`: tests/test_tutorial.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpctrain.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
QUICK = ["data.max_train_samples=5000", "train.epochs=1", "train.progress=false"]


def hpctrain(*args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}  # 3 test workers share the 2 cores
    return subprocess.run([sys.executable, "-m", "hpctrain", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    return proc


@pytest.fixture(scope="module")
def single_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("mnist1")
    ok(hpctrain("train", *QUICK, f"run.dir={run}"))
    return run


def test_single_process_reaches_93_percent(single_run):
    summary = json.loads((single_run / "summary.json").read_text())
    assert summary["val_accuracy"] >= 0.93
    assert summary["val_count"] == 10_000 and summary["world_size"] == 1
    assert summary["steps"] == 5000 // 64
    assert len(summary["params_sha256"]) == 64
    assert (single_run / "model.pt").is_file() and (single_run / "config.yaml").is_file()
    rows = [json.loads(line) for line in (single_run / "metrics.jsonl").read_text().splitlines()]
    assert {"step", "epoch", "loss", "lr", "samples_per_s"} <= rows[0].keys()


def test_eval_at_three_ranks_equals_one(single_run, tmp_path):
    args = ["data.max_val_samples=1001", "--weights", str(single_run / "model.pt")]
    assert cli_main(["eval", *args, "--out", str(tmp_path / "one")]) == 0  # one process: this one
    ok(hpctrain("run", "-n", "3", "eval", *args, "--out", str(tmp_path / "three"), "--predictions"))
    one = json.loads((tmp_path / "one" / "eval.json").read_text())
    three = json.loads((tmp_path / "three" / "eval.json").read_text())
    assert one["count"] == three["count"] == 1001
    assert one["correct"] == three["correct"] and abs(one["loss"] - three["loss"]) <= 1e-6 * one["loss"]
    rows = (tmp_path / "three" / "predictions.jsonl").read_text().splitlines()
    assert sorted(json.loads(r)["key"] for r in rows) == list(range(1001))


def test_finished_run_is_not_overwritten(single_run, capsys):
    before = (single_run / "summary.json").read_bytes()
    assert cli_main(["train", *QUICK, f"run.dir={single_run}"]) == 2
    assert "already holds a finished run" in capsys.readouterr().err
    assert (single_run / "summary.json").read_bytes() == before
