"""`hpctrain train` with the causal_lm task: a tiny GPT (2 layers, hidden 32, seq 32) on
Shakespeare through train(): the loss falls, the summary reports tokens/s and perplexity,
a resume is bit-identical, and `hpctrain run -n 2 eval` equals one process exactly."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpctrain.cli import main as cli_main
from hpctrain.config import load_config
from hpctrain.core.errors import UserError
from hpctrain.train import train
from tests.data.test_text import needs_sdist

ROOT = Path(__file__).resolve().parents[2]
pytestmark = needs_sdist
GPT = ["model.name=gpt", "model.n_layers=2", "model.hidden=32", "model.heads=4", "model.seq_len=32"]
# no train.task, no train.best_metric: both are auto and follow the data
BASE = [*GPT, "data.name=shards", "data.batch_size=16", "data.max_val_samples=96", "train.max_steps=20",
        "train.log_every=1", "train.progress=false", "train.threads=1", "optim.name=adamw", "optim.lr=0.01",
        "checkpoint.every_seconds=None"]


@pytest.fixture(scope="module")
def shards(shakespeare_shards: Path) -> Path:
    return shakespeare_shards


def _train(shards: Path, run: Path, *extra: str) -> dict:
    return train(load_config(None, [*BASE, f"data.path={shards}", f"run.dir={run}", *extra]))


def _losses(run: Path) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [row["loss"] for row in rows if "loss" in row]


def test_gpt_trains_on_shakespeare_and_reports_tokens_and_perplexity(shards: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    summary = _train(shards, run)
    losses = _losses(run)
    assert len(losses) == 20 and losses[0] > 5.0  # ln(256) = 5.55: uniform over bytes at the start
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0, losses
    assert summary["task"] == "causal_lm" and summary["steps"] == 20
    assert summary["val_count"] == 96 and summary["val_tokens"] == 96 * 32
    assert math.isclose(summary["val_perplexity"], math.exp(summary["val_loss"]), rel_tol=1e-12)
    assert summary["val_loss"] < 4.5
    # tokens/s counts the model's 32 input tokens per sample, not the 33-token window
    assert summary["tokens_per_s"] == pytest.approx(summary["samples_per_s"] * 32, rel=1e-9)
    assert summary["best"]["metric"] == "val_loss"  # train.best_metric=auto for causal_lm
    written = json.loads((run / "summary.json").read_text())
    assert written["val_perplexity"] == summary["val_perplexity"] and written["tokens_per_s"] > 0


def test_resume_after_a_stop_is_bit_identical(shards: Path, tmp_path: Path) -> None:
    """Dropout on: the resumed run must restore the RNG and the data position too."""
    extra = ["model.dropout=0.1", "optim.schedule=constant", "checkpoint.every_steps=6"]
    ref = _train(shards, tmp_path / "ref", *extra)
    run = tmp_path / "run"
    _train(shards, run, *extra, "train.max_steps=9", "checkpoint.at_end=false")  # "killed" after step 9
    (run / "summary.json").unlink()  # an unfinished run: resume=auto continues it from step 6
    resumed = _train(shards, run, *extra)
    assert resumed["steps"] == 20 and resumed["params_sha256"] == ref["params_sha256"]
    assert _losses(run)[-14:] == _losses(tmp_path / "ref")[-14:]


def test_a_named_task_must_fit_the_data(shards: Path, tmp_path: Path) -> None:
    with pytest.raises(UserError, match="train.task=classification does not fit"):
        _train(shards, tmp_path / "run", "train.task=classification")


def test_eval_of_the_weights_at_two_ranks_equals_one(shards: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    _train(shards, run, "train.max_steps=5", "checkpoint.enabled=false")
    args = ["eval", "--weights", str(run / "model.pt"), *GPT, "data.name=shards", f"data.path={shards}",
            "data.max_val_samples=95"]  # odd: the ranks' shares differ
    assert cli_main([*args, "--out", str(tmp_path / "one")]) == 0
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "hpctrain", "run", "-n", "2", *args, "--out", str(tmp_path / "two")],
                          capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, two = (json.loads((tmp_path / d / "eval.json").read_text()) for d in ("one", "two"))
    assert (one["world_size"], two["world_size"], one["task"]) == (1, 2, "causal_lm")
    keys = ("count", "tokens", "correct", "loss", "perplexity", "accuracy")
    assert {k: one[k] for k in keys} == {k: two[k] for k in keys}
    assert one["count"] == 95 and one["tokens"] == 95 * 32
