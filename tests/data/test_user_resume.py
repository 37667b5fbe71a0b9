"""Proof for a user's own map-style Dataset (data.name=tests.data.user_datasets:NAME), trained at 2
ranks: SIGKILLed mid-epoch after a checkpoint, the same job resumes to bit-identical final weights;
a world-2 checkpoint resumed at 3 ranks reads every remaining sample of the epoch exactly once."""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from hpctrain.checkpoint import layout
from hpctrain.config import load_config
from hpctrain.data.position import epoch_order
from tests.checkpoint import test_preempt as preempt
from tests.dist_utils import train_cases

MOD = "tests.data.user_datasets"
# 50 samples, 6 a step at any world size (3 per rank at 2, 2 at 3): 8 steps an epoch, 24 in all
BASE = [f"model.name={MOD}:slow_mlp", "data.global_batch_size=6", "data.batch_size=3", "train.epochs=3",
        "train.log_every=1", "train.progress=false", "train.threads=1", "checkpoint.every_seconds=None",
        "optim.lr=0.05"]
MAKE = f"data.name={MOD}:make"
STEP5 = Path("checkpoints") / layout.step_name(5)


@pytest.fixture(scope="module")
def world2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run and one that checkpoints at step 5 (mid-epoch 0), on one forked pair of ranks."""
    root = tmp_path_factory.mktemp("w2")
    cases = [("ref", [*BASE, MAKE, "checkpoint.enabled=false"]),
             ("saved", [*BASE, MAKE, "checkpoint.every_steps=5", "checkpoint.keep_last=5"])]
    got = train_cases(2, cases, root, keep=("params_sha256", "steps"))[0]
    assert all(isinstance(v, dict) and v["steps"] == 24 for v in got.values()), got
    return root


def _sha(run: Path) -> str:
    return str(json.loads((run / "summary.json").read_text())["params_sha256"])


def test_sigkill_mid_epoch_then_the_same_job_is_bit_identical(world2: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    keys = [*BASE, MAKE, "checkpoint.every_steps=3"]
    proc = preempt._start([sys.executable, "-m", "hpctrain", "run", "-n", "2", "train", *keys, f"run.dir={run}"])
    preempt._wait_for_step(run, random.Random().randint(5, 18), proc)
    while not layout.committed(run / "checkpoints"):  # a save may still be in flight at that step
        assert proc.poll() is None, "the run ended before its first checkpoint"
        time.sleep(0.01)
    for pid in [*preempt._workers(proc.pid), proc.pid]:
        os.kill(pid, signal.SIGKILL)  # nothing gets to clean up, as on a node failure
    proc.communicate()
    assert not (run / "summary.json").exists()
    got = train_cases(2, [("run", keys)], tmp_path, keep=("steps",))[0]["run"]  # the same job again: resume=auto
    assert got == {"steps": 24}
    assert _sha(run) == _sha(world2 / "ref")


def test_a_world_2_checkpoint_resumes_at_3_ranks_reading_every_sample_once(world2: Path, tmp_path: Path) -> None:
    logs = tmp_path / "reads"
    logs.mkdir()
    keys = [*BASE, f"data.name={MOD}:make_logged", f"data.path={logs}", f"resume={world2 / 'saved' / STEP5}"]
    got = train_cases(3, [("at3", keys)], tmp_path, keep=("steps", "val_count"))[0]["at3"]
    assert got == {"steps": 24, "val_count": 21}
    reads = Counter(int(line) for f in logs.glob("reads-*.txt") for line in f.read_text().split())
    reads[0] -= 3  # each rank reads sample 0 once at the start: the input shape
    seed = load_config(None, []).seed
    orders = [epoch_order([50], seed, epoch).tolist() for epoch in range(3)]
    # the world-2 run read positions [0, 30) of epoch 0 before its checkpoint at step 5; the rest is read
    # here, then epochs 1 and 2 whole: 48 of 50 samples an epoch (drop_last: 50 % 6 left out)
    want = Counter(orders[0][30:48] + orders[1][:48] + orders[2][:48])
    assert +reads == want
    assert sorted(orders[0][:30] + orders[0][30:48]) == sorted(set(orders[0][:48]))  # epoch 0: each once
