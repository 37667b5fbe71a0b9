"""Resume across strategies: the checkpoint's manifest, not the config, says how it loads. An FSDP
checkpoint (DCP, world 2) resumes under DDP at world 2 and in one process, and a DDP checkpoint
(format=torch, whole state) under FSDP at world 2; each continues with the saved run's next-step
losses (1e-5), lr and data position (the same batches, the same sample count)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpctrain.checkpoint import layout
from hpctrain.config import load_config
from hpctrain.train import train
from tests.data.test_text import needs_sdist
from tests.dist_utils import train_cases

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


STEP5 = Path("checkpoints") / layout.step_name(5)


@pytest.fixture(scope="module")
def two_ranks(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every world-2 run on one forked pair of ranks, in turn; run NAME is ``root / NAME``."""
    root = tmp_path_factory.mktemp("across")
    cases = [("fsdp", ["parallel.strategy=fsdp", "checkpoint.every_steps=5"]),
             ("fsdp-into-ddp", ["parallel.strategy=ddp", "checkpoint.format=torch", f"resume={root / 'fsdp' / STEP5}"]),
             ("ddp", ["checkpoint.every_steps=5"]),
             ("ddp-into-fsdp", ["parallel.strategy=fsdp", f"resume={root / 'ddp' / STEP5}"])]  # whole -> shards
    ranks = train_cases(2, [(name, [*BASE, f"data.path={shards}", *keys]) for name, keys in cases], root,
                        keep=("steps",))
    failed = {name: got for name, got in ranks[0].items() if not isinstance(got, dict)}
    assert not failed, failed
    return root


@pytest.mark.parametrize("world", [1, 2])
def test_fsdp_checkpoint_resumes_into_ddp(shards: Path, two_ranks: Path, tmp_path: Path, world: int) -> None:
    fsdp_run = two_ranks / "fsdp"
    ckpt = fsdp_run / STEP5
    assert layout.read_manifest(ckpt)["format"] == "dcp"
    if world == 1:
        run = tmp_path / "ddp"
        train(load_config(None, [*BASE, f"data.path={shards}", f"run.dir={run}", "parallel.strategy=ddp",
                                 "checkpoint.format=torch", f"resume={ckpt}"]))
    else:
        run = two_ranks / "fsdp-into-ddp"
    _continues(run, fsdp_run, 5)
    # and it checkpoints on in its own format: whole state, written by rank 0
    assert layout.read_manifest(run / "checkpoints" / layout.step_name(10))["format"] == "torch"


def test_ddp_checkpoint_resumes_into_fsdp(two_ranks: Path) -> None:
    saved, run = two_ranks / "ddp", two_ranks / "ddp-into-fsdp"
    assert layout.read_manifest(saved / STEP5)["format"] == "torch"
    _continues(run, saved, 5)
    assert layout.read_manifest(run / "checkpoints" / layout.step_name(10))["format"] == "dcp"
