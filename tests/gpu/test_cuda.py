"""The CUDA paths, on a machine with an NVIDIA GPU (skipped without one; CI has none).

Run there as ``python3 -m pytest -p no:cacheprovider tests/gpu -n 4`` (scripts/gpu_check.sh does it,
with the data these tests read): every precision on the GPU with the telemetry a GPU adds (its
peak, MFU, measured memory, NVML columns), float8 on Hopper, a bit-identical resume with dropout
(the CUDA generator's state is part of the checkpoint) from sync and async checkpoints, compile,
the data loader's pinned workers, two ranks sharing one GPU over gloo, and the README's MNIST job.
What one GPU cannot show (NCCL between ranks, torch's ring attention, SyncBatchNorm) is not here.
Results of the last run on a GPU: docs/benchmarks.md ("GPU throughput ...")."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hpctrain.config import load_config
from hpctrain.train import train

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")

GPT = ["model.name=gpt", "model.n_layers=2", "model.hidden=128", "model.heads=4", "model.seq_len=32",
       "data.name=shards", "data.batch_size=16", "data.max_val_samples=96", "train.max_steps=30",
       "train.log_every=1", "train.progress=false", "optim.name=adamw", "optim.lr=0.003",
       "optim.schedule=constant", "checkpoint.every_seconds=None"]


def _train(shards: Path, run: Path, *extra: str) -> dict:
    return train(load_config(None, [*GPT, f"data.path={shards}", f"run.dir={run}", *extra]))


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _losses(run: Path) -> list[float]:
    return [row["loss"] for row in _rows(run) if "loss" in row]


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_gpt_trains_on_the_gpu_in_each_precision(shakespeare_shards: Path, tmp_path: Path, precision: str) -> None:
    run = tmp_path / "run"
    workers = ["data.num_workers=2"] if precision == "bf16" else []  # pinned batches from worker processes
    summary = _train(shakespeare_shards, run, f"precision={precision}", *workers)
    losses = _losses(run)
    assert len(losses) == 30 and all(math.isfinite(x) for x in losses)
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0, losses
    assert summary["val_count"] == 96 and summary["precision"] == precision
    # the GPU's own peak (its table row), not the CPU probe, and an MFU below 1
    assert torch.cuda.get_device_name() in summary["peak_source"], summary["peak_source"]
    assert 0 < summary["mfu"] < 1 and summary["mem_peak_gb"] > 0
    breakdown = summary["memory_breakdown"][0]
    assert breakdown["params_bytes"] == breakdown["predicted"]["params_bytes"]
    assert breakdown["optimizer_bytes"] == pytest.approx(breakdown["predicted"]["optimizer_bytes"], rel=0.01)
    if precision == "fp16":
        assert summary["scaler_skipped_steps"] < 10  # the GradScaler found its scale
    try:
        import pynvml  # noqa: F401  (nvidia-ml-py)
    except ImportError:
        return
    assert any("gpu_util" in row for row in _rows(run))


def test_fp8_trains_on_hopper(shakespeare_shards: Path, tmp_path: Path) -> None:
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("float8 training needs compute capability 9.0")
    pytest.importorskip("torchao.float8")
    run = tmp_path / "run"
    summary = _train(shakespeare_shards, run, "precision=fp8")
    losses = _losses(run)
    assert all(math.isfinite(x) for x in losses) and sum(losses[-5:]) / 5 < losses[0] - 1.0, losses
    assert summary["precision"] == "fp8"
    bf16 = _train(shakespeare_shards, tmp_path / "bf16", "precision=bf16")
    assert abs(summary["val_loss"] - bf16["val_loss"]) < 0.1  # float8 matmuls train about as bf16 does


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_resume_on_the_gpu_is_bit_identical(shakespeare_shards: Path, tmp_path: Path, mode: str) -> None:
    """Dropout on the GPU: the resumed run must restore the CUDA generator, not only the CPU's."""
    extra = ["model.dropout=0.1", "train.deterministic=true", "checkpoint.every_steps=12", f"checkpoint.mode={mode}"]
    ref = _train(shakespeare_shards, tmp_path / "ref", *extra)
    run = tmp_path / "run"
    _train(shakespeare_shards, run, *extra, "train.max_steps=17", "checkpoint.at_end=false")  # "killed" after 17
    (run / "summary.json").unlink()  # unfinished: resume=auto continues from step 12
    resumed = _train(shakespeare_shards, run, *extra)
    assert resumed["steps"] == 30 and resumed["params_sha256"] == ref["params_sha256"]
    assert _losses(run)[-18:] == _losses(tmp_path / "ref")[-18:]


def test_compiled_training_matches_eager(shakespeare_shards: Path, tmp_path: Path) -> None:
    eager = _train(shakespeare_shards, tmp_path / "eager", "train.max_steps=10")
    compiled = _train(shakespeare_shards, tmp_path / "compiled", "train.max_steps=10", "train.compile=true")
    got, want = _losses(tmp_path / "compiled"), _losses(tmp_path / "eager")
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 2e-3, (got, want)
    assert compiled["val_loss"] == pytest.approx(eager["val_loss"], abs=2e-3)


# FSDP's case on an H200 with torch 2.11 (27 Nov 2026): trained and validated, then rank 1 died with SIGSEGV
# at the end of the run; NCCL (one GPU per rank) is the supported way, and one GPU cannot show it
FSDP_OVER_GLOO = pytest.param("fsdp", marks=pytest.mark.xfail(reason="SIGSEGV at the run's end, torch 2.11's gloo "
                                                                     "with CUDA tensors", strict=False))


@pytest.mark.parametrize("strategy", ["ddp", FSDP_OVER_GLOO])
def test_two_ranks_share_one_gpu_over_gloo(shakespeare_shards: Path, tmp_path: Path, strategy: str) -> None:
    """Two ranks on one GPU (NCCL refuses that; gloo moves CUDA tensors) train as one process does."""
    same = ["train.max_steps=10", "data.global_batch_size=16"]  # the same global batches at either size
    one = _train(shakespeare_shards, tmp_path / "one", *same)
    args = [*GPT, f"data.path={shakespeare_shards}", f"run.dir={tmp_path / 'two'}", *same,
            f"parallel.strategy={strategy}", "parallel.backend=gloo"]
    proc = subprocess.run([sys.executable, "-m", "hpctrain", "run", "-n", "2", "train", *args],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    two = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert two["world_size"] == 2 and two["val_count"] == one["val_count"] == 96
    assert two["val_loss"] == pytest.approx(one["val_loss"], abs=1e-4)


def test_the_readme_mnist_job_on_the_gpu(tmp_path: Path) -> None:
    """The README's first command (`hpctrain train`), with MNIST's file named by HPCTRAIN_MNIST."""
    mnist = os.environ.get("HPCTRAIN_MNIST")
    if not mnist:
        pytest.skip("HPCTRAIN_MNIST (mnist.pkl.gz) not set")
    proc = subprocess.run([sys.executable, "-m", "hpctrain", "train", f"data.path={mnist}", f"run.dir={tmp_path / 'r'}",
                           "train.progress=false"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["val_accuracy"] > 0.97 and summary["val_count"] == 10_000
