"""Resume across strategies: the checkpoint's manifest, not the config, says how it loads. An FSDP
checkpoint (DCP, world 2) resumes under DDP at world 2 and in one process, and a DDP checkpoint
(format=torch, whole state) under FSDP at world 2; each continues with the saved run's next-step
losses (1e-5), lr and data position (the same batches, the same sample count)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpctrain.checkpoint import layout
from hpctrain.config import load_config
from hpctrain.train import train
from tests.data.test_text import needs_sdist

ROOT = Path(__file__).resolve().parents[2]
pytestmark = needs_sdist
TOL = 1e-5
# 16 samples a step: 4 per micro-batch, 4 micro-steps at world 1, 2 at world 2
BASE = ["model.name=gpt", "model.n_layers=2", "model.hidden=32", "model.heads=4", "model.seq_len=32",
        "data.name=shards", "data.batch_size=4", "data.global_batch_size=16", "data.max_val_samples=41",
        "data.eval_batch_size=4", "train.max_steps=10", "train.log_every=1", "train.progress=false",
        "train.threads=1", "train.clip_grad_norm=0.5", "optim.name=adamw", "optim.lr=0.01",
        "optim.schedule=cosine", "optim.warmup_steps=2", "checkpoint.every_seconds=None"]


@pytest.fixture(scope="module")
def shards(shakespeare_shards: Path) -> Path:
    return shakespeare_shards


def _run(n: int, shards: Path, run: Path, *extra: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "hpctrain", "run", "-n", str(n), "train", *BASE, f"data.path={shards}",
           f"run.dir={run}", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stderr[-4000:]}"


def _rows(run: Path) -> dict[int, dict[str, float]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row for row in rows if "loss" in row}


def _continues(resumed: Path, saved: Path, after: int) -> None:
    """``resumed`` went on from step ``after`` as ``saved`` did: same losses, lr, samples."""
    want, got = _rows(saved), _rows(resumed)
    assert sorted(got) == [s for s in sorted(want) if s > after]
    worst = max(abs(got[s]["loss"] - want[s]["loss"]) for s in got)
    assert worst < TOL, (worst, got, want)
    assert [got[s]["lr"] for s in got] == [want[s]["lr"] for s in got]
    one, two = (json.loads((r / "summary.json").read_text()) for r in (saved, resumed))
    assert two["samples_seen"] == one["samples_seen"] == 160  # the data position was kept


@pytest.fixture(scope="module")
def fsdp_run(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("fsdp") / "run"
    _run(2, shards, run, "parallel.strategy=fsdp", "checkpoint.every_steps=5")
    return run


@pytest.mark.parametrize("world", [1, 2])
def test_fsdp_checkpoint_resumes_into_ddp(shards: Path, fsdp_run: Path, tmp_path: Path, world: int) -> None:
    ckpt = fsdp_run / "checkpoints" / layout.step_name(5)
    assert layout.read_manifest(ckpt)["format"] == "dcp"
    run = tmp_path / "ddp"
    resume = ["parallel.strategy=ddp", "checkpoint.format=torch", f"resume={ckpt}"]
    if world == 1:
        train(load_config(None, [*BASE, f"data.path={shards}", f"run.dir={run}", *resume]))
    else:
        _run(world, shards, run, *resume)
    _continues(run, fsdp_run, 5)
    # and it checkpoints on in its own format: whole state, written by rank 0
    assert layout.read_manifest(run / "checkpoints" / layout.step_name(10))["format"] == "torch"


def test_ddp_checkpoint_resumes_into_fsdp(shards: Path, tmp_path: Path) -> None:
    saved = tmp_path / "ddp"
    _run(2, shards, saved, "checkpoint.every_steps=5")
    ckpt = saved / "checkpoints" / layout.step_name(5)
    assert layout.read_manifest(ckpt)["format"] == "torch"
    run = tmp_path / "fsdp"
    _run(2, shards, run, "parallel.strategy=fsdp", f"resume={ckpt}")  # whole state -> each rank's shards
    _continues(run, saved, 5)
    assert layout.read_manifest(run / "checkpoints" / layout.step_name(10))["format"] == "dcp"
