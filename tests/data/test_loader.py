"""ShardedLoader: one global order, rank x worker split, exactly-once epochs, exact and elastic resume,
staging, and the trainer running from shards."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from hpctrain.core.env import ClusterEnv
from hpctrain.data.loader import ShardedEvalLoader, ShardedLoader
from hpctrain.data.position import PAD, epoch_order, limit_order, rank_batches, remaining_batches
from hpctrain.data.shard_index import ShardIndex
from tests.data.test_shards import make_shards
from tests.dist_utils import run_ranks

SIZES = [7, 7, 7, 3, 11]  # 35 samples in shards that divide nothing evenly


def env_of(rank: int, world: int) -> ClusterEnv:
    return ClusterEnv(rank=rank, local_rank=rank, world_size=world, local_world_size=world)


def real_keys(batches) -> list[str]:
    out = []
    for b in batches:
        mask = b.mask.tolist() if b.mask is not None else [True] * len(b)
        out += [k for k, m in zip(b.keys, mask) if m]
    return out


# ---------------------------------------------------------------- the pure plan


@pytest.mark.parametrize("shuffle", ["global", "shard", "window", "none"])
def test_epoch_order_is_a_permutation_fixed_by_seed_and_epoch(shuffle):
    a = epoch_order(SIZES, seed=3, epoch=1, shuffle=shuffle, window=4)
    assert sorted(a.tolist()) == list(range(35))
    assert np.array_equal(a, epoch_order(SIZES, 3, 1, shuffle, 4))
    if shuffle != "none":
        assert not np.array_equal(a, epoch_order(SIZES, 3, 2, shuffle, 4))
    if shuffle in ("shard", "window"):  # contiguous runs per shard: reads stay inside one file
        firsts = np.cumsum([0] + SIZES)
        shard_of = np.searchsorted(firsts, a, side="right") - 1
        assert (np.diff(shard_of) != 0).sum() == len(SIZES) - 1
    assert limit_order(a, 10).tolist() == [i for i in a.tolist() if i < 10]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("batch", [1, 3, 4])
@pytest.mark.parametrize("drop_last", [True, False])
def test_rank_split_reads_every_position_once(world, batch, drop_last):
    total = sum(SIZES)
    plans = [rank_batches(total, 0, batch, world, r, drop_last) for r in range(world)]
    assert len({len(p) for p in plans}) == 1, "equal batches per rank"
    got = Counter(p for plan in plans for b in plan for p in b if p != PAD)
    assert all(c == 1 for c in got.values())
    kept = (total // (batch * world)) * batch * world if drop_last else total
    assert sorted(got) == list(range(kept))


@pytest.mark.parametrize("w1,w2", [(2, 3), (3, 1), (1, 4), (4, 2)])
def test_elastic_resume_plan_covers_the_rest_once(w1, w2):
    total, batch = 35, 2
    done = 3  # batches per rank consumed at world size w1
    position = done * batch * w1
    first = {p for r in range(w1) for b in rank_batches(total, 0, batch, w1, r, False)[:done] for p in b}
    rest = Counter(p for r in range(w2) for b in rank_batches(total, position, batch, w2, r, False)
                   for p in b if p != PAD)
    assert first.isdisjoint(rest) and all(c == 1 for c in rest.values())
    assert first | set(rest) == set(range(total))
    assert remaining_batches(total, position, batch, w2, True) == (total - position) // (batch * w2)


# ---------------------------------------------------------------- real loaders, in one process


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("shards")
    return make_shards(root, n=35, per_shard=7, kind="npy")


@pytest.fixture(scope="module")
def uneven(tmp_path_factory) -> Path:
    return make_shards(tmp_path_factory.mktemp("uneven"), n=45, per_shard=7, kind="png")


@pytest.fixture(scope="module")
def four_shards(tmp_path_factory) -> Path:
    return make_shards(tmp_path_factory.mktemp("four"), n=45, per_shard=13, kind="npy")  # 13, 13, 13, 6


# every world size x worker count on one layout; the second layout with 0 and 3 workers
MATRIX = [("7x7+3", w, k) for w in (1, 2, 3, 4) for k in (0, 1, 2, 3)] + \
         [("3x13+6", w, k) for w in (1, 2, 3, 4) for k in (0, 3)]


@pytest.mark.parametrize("layout,world,workers", MATRIX)
def test_exactly_once_per_epoch_world_by_workers(uneven, four_shards, layout, world, workers):
    root = uneven if layout == "7x7+3" else four_shards
    loaders = [ShardedLoader(root, env_of(r, world), 3, seed=1, drop_last=False, num_workers=workers,
                             persistent_workers=False) for r in range(world)]
    lengths = {len(ld) for ld in loaders}
    assert len(lengths) == 1
    for epoch in (0, 1):
        per_rank = []
        for ld in loaders:
            ld.set_epoch(epoch)
            batches = list(ld)
            assert len(batches) == len(ld) and all(len(b) == 3 for b in batches)
            per_rank.append(real_keys(batches))
        keys = [k for ks in per_rank for k in ks]
        assert Counter(keys) == Counter(f"s{i:05d}" for i in range(45)), f"epoch {epoch}"
    # the global order does not depend on the world size or workers
    single = ShardedLoader(root, env_of(0, 1), 3 * world, seed=1, drop_last=False)
    single.set_epoch(1)
    assert real_keys(single) == [k for step in zip(*[_batches_keys(ld, 1) for ld in loaders]) for b in step for k in b]


def _batches_keys(loader: ShardedLoader, epoch: int) -> list[list[str]]:
    loader.set_epoch(epoch)
    return [[k for k, m in zip(b.keys, (b.mask if b.mask is not None else torch.ones(len(b))).tolist()) if m]
            for b in loader]


def test_drop_last_gives_equal_full_batches(uneven):
    loaders = [ShardedLoader(uneven, env_of(r, 4), 4, seed=0) for r in range(4)]
    keys = []
    for ld in loaders:
        batches = list(ld)
        assert len(ld) == 45 // 16 == len(batches) and all(b.mask is None and len(b) == 4 for b in batches)
        keys += real_keys(batches)
    assert len(keys) == len(set(keys)) == 32


def test_resume_same_world_reproduces_the_batches(uneven):
    def run(resume_after: int | None, workers: int):
        out = []
        for r in range(2):
            ld = ShardedLoader(uneven, env_of(r, 2), 3, seed=5, num_workers=workers, persistent_workers=False)
            ld.set_epoch(1)
            if resume_after is None:
                out.append([b.keys for b in ld])
                continue
            it = iter(ld)
            head = [next(it).keys for _ in range(resume_after)]
            state = json.loads(json.dumps(ld.state_dict()))  # small and JSON-able
            assert state["position"] == resume_after * 3 * 2 and ld.batches_done == resume_after
            fresh = ShardedLoader(uneven, env_of(r, 2), 3, seed=5, num_workers=workers)
            fresh.load_state_dict(state)
            fresh.set_epoch(1)  # the trainer calls this again; it must keep the position
            assert fresh.batches_done == resume_after
            out.append(head + [b.keys for b in fresh])
            assert fresh.epoch == 2 and fresh.state_dict()["position"] == 0
        return out
    full = run(None, 0)
    assert run(2, 0) == full
    assert run(4, 2) == full  # another worker count: the same batches


@pytest.mark.parametrize("w1,w2", [(2, 3), (3, 1)])
def test_resume_at_another_world_size_reads_the_rest_once(uneven, w1, w2):
    done = 2
    first, state = [], None
    for r in range(w1):
        ld = ShardedLoader(uneven, env_of(r, w1), 3, seed=2, drop_last=False)
        it = iter(ld)
        first += real_keys([next(it) for _ in range(done)])
        state = ld.state_dict()
    rest = []
    for r in range(w2):
        ld = ShardedLoader(uneven, env_of(r, w2), 3, seed=2, drop_last=False, num_workers=1 if r == 0 else 0,
                           persistent_workers=False)
        ld.load_state_dict(state)
        assert len(ld) - ld.batches_done == -(-(45 - done * 3 * w1) // (3 * w2))
        rest += real_keys(ld)
    assert Counter(first + rest) == Counter(f"s{i:05d}" for i in range(45))


def test_state_from_other_data_is_refused(uneven, shards):
    state = ShardedLoader(uneven, env_of(0, 1), 3).state_dict()
    with pytest.raises(ValueError, match="num_samples"):
        ShardedLoader(shards, env_of(0, 1), 3).load_state_dict(state)


def test_max_samples_and_eval_split(uneven):
    ld = ShardedLoader(uneven, env_of(0, 1), 4, max_samples=20, drop_last=False)
    assert sorted(real_keys(ld)) == [f"s{i:05d}" for i in range(20)]
    evals = [ShardedEvalLoader(uneven, env_of(r, 4), 5, split="train") for r in range(4)]
    keys = [k for e in evals for b in e for k in b.keys]
    assert keys == [f"s{i:05d}" for i in range(45)]  # each rank a contiguous share, in order
    assert evals[0].template().inputs.shape == (1, 1, 8, 8)


# ---------------------------------------------------------------- real ranks (gloo)


def _rank_epoch(env: ClusterEnv, root: str, workers: int) -> list[str]:
    ld = ShardedLoader(root, env, 4, seed=9, drop_last=False, num_workers=workers, persistent_workers=True)
    keys = []
    for epoch in (0, 1):
        ld.set_epoch(epoch)
        keys.append(real_keys(ld))
    return keys


def test_real_ranks_split_an_epoch(uneven):
    # run_ranks starts daemonic processes, which may not start DataLoader workers: workers are
    # covered in-process (above and below); here the ranks are real gloo processes.
    per_rank = run_ranks(3, _rank_epoch, str(uneven), 0)
    for epoch in (0, 1):
        keys = [k for r in per_rank for k in r[epoch]]
        assert Counter(keys) == Counter(f"s{i:05d}" for i in range(45))
    assert per_rank[0][0] != per_rank[0][1]


def test_persistent_workers_follow_each_epoch_and_a_stopped_epoch(uneven):
    ld = ShardedLoader(uneven, env_of(1, 2), 4, seed=9, drop_last=False, num_workers=2, persistent_workers=True)
    ref = ShardedLoader(uneven, env_of(1, 2), 4, seed=9, drop_last=False)
    it = iter(ld)
    next(it)  # the trainer may leave an epoch early (max_steps, grad_accum remainder)
    for epoch in (1, 2):
        ld.set_epoch(epoch)
        ref.set_epoch(epoch)
        assert [b.keys for b in ld] == [b.keys for b in ref]


def _stage_rank(env: ClusterEnv, source: str, stage: str) -> tuple[str, list[str]]:
    from hpctrain.data.stage import stage_shards

    root = stage_shards(Path(source), Path(stage), env, ["train"])
    ld = ShardedLoader(root, env, 5, drop_last=False)
    return str(root), real_keys(ld)


def test_staging_copies_once_verifies_and_is_reused(uneven, tmp_path, caplog):
    from hpctrain.data.stage import resolve_stage_dir, stage_shards
    from hpctrain.data.verify import verify

    results = run_ranks(2, _stage_rank, str(uneven), str(tmp_path / "local"))
    roots = {r[0] for r in results}
    assert len(roots) == 1 and Path(roots.pop()).parent == tmp_path / "local"
    assert Counter(k for r in results for k in r[1]) == Counter(f"s{i:05d}" for i in range(45))
    target = next((tmp_path / "local").iterdir())
    assert verify(target, "train") == []
    marker = json.loads((target / ".staged.json").read_text())
    assert marker["mb_per_s"] > 0
    caplog.set_level("INFO", logger="hpctrain")
    assert stage_shards(uneven, tmp_path / "local", env_of(0, 1), ["train"]) == target
    assert "reusing" in caplog.text
    assert resolve_stage_dir(None, {"SLURM_TMPDIR": "/scratch/x"}) == Path("/scratch/x")
    assert resolve_stage_dir("off", {"SLURM_TMPDIR": "/scratch/x"}) is None
    assert resolve_stage_dir(None, {}) is None


# ---------------------------------------------------------------- the trainer


def test_train_runs_from_mnist_shards(tmp_path, monkeypatch):
    import itertools

    from hpctrain.config import load_config
    from hpctrain.data.sources import open_source
    from hpctrain.data.writer import write_shards
    from hpctrain.train import train

    for split, n in (("train", 256), ("val", 64)):
        src = open_source("mnist", split)
        write_shards(itertools.islice(src.samples, n), tmp_path / "shards", split, samples_per_shard=100, meta=src.meta)
    monkeypatch.setenv("SLURM_TMPDIR", str(tmp_path / "tmp"))  # staging on by default under Slurm
    cfg = load_config(None, [f"data.path={tmp_path / 'shards'}", "data.name=shards", "data.batch_size=32",
                             f"run.dir={tmp_path / 'run'}", "train.progress=false", "train.log_every=2"])
    summary = train(cfg)
    assert summary["steps"] == 8 and summary["val_count"] == 64 and summary["samples_seen"] == 256
    assert any((tmp_path / "tmp").iterdir())


def test_staging_refuses_a_bad_copy_and_refreshes_a_stale_one(tmp_path):
    from hpctrain.data.stage import StageError, is_current, stage_shards

    src = make_shards(tmp_path / "src", n=10, per_shard=5)
    target = stage_shards(src, tmp_path / "local", env_of(0, 1), ["train"])
    make_shards(src, n=12, per_shard=5)  # re-sharded: the staged copy is stale now
    assert not is_current(src, target, ["train"])
    assert len(ShardIndex(stage_shards(src, tmp_path / "local", env_of(0, 1), ["train"]), "train")) == 12
    with open(src / "train-000000.tar", "r+b") as fh:  # the source no longer matches its manifest
        fh.seek(700)
        fh.write(b"\x01")
    (target / ".staged.json").unlink()
    with pytest.raises(StageError, match="train-000000.tar"):
        stage_shards(src, tmp_path / "local", env_of(0, 1), ["train"])


@pytest.mark.slow
def test_two_torchrun_ranks_with_workers_and_staging(tmp_path):
    """The real path: `hpctrain run -n 2` (torchrun), DataLoader workers inside each rank,
    node-local staging with a barrier, then validation on shards."""
    import itertools
    import subprocess
    import sys

    from hpctrain.data.sources import open_source
    from hpctrain.data.writer import write_shards

    for split, n in (("train", 256), ("val", 70)):
        src = open_source("mnist", split)
        write_shards(itertools.islice(src.samples, n), tmp_path / "shards", split, samples_per_shard=60, meta=src.meta)
    args = ["run", "-n", "2", "train", "data.name=shards", f"data.path={tmp_path / 'shards'}", "data.batch_size=16",
            "data.num_workers=1", f"data.stage_dir={tmp_path / 'local'}", "train.progress=false",
            f"run.dir={tmp_path / 'run'}"]
    proc = subprocess.run([sys.executable, "-m", "hpctrain", *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["val_count"] == 70 and summary["world_size"] == 2
    assert "staged" in proc.stderr


def test_skipped_samples_reach_the_summary_and_eval_reads_shards(tmp_path):
    import itertools

    from hpctrain.config import load_config
    from hpctrain.data.sources import open_source
    from hpctrain.data.writer import write_shards
    from hpctrain.evaluation.job import run_eval
    from hpctrain.train import train
    from tests.data.test_shards import flip_byte

    root = tmp_path / "shards"
    for split, n in (("train", 128), ("val", 50)):
        src = open_source("mnist", split)
        write_shards(itertools.islice(src.samples, n), root, split, samples_per_shard=64, meta=src.meta)
    index = json.loads((root / "train-000000.idx.json").read_text())
    flip_byte(root / "train-000000.tar", index["start"][3] + index["offsets"][3][2] + 40)  # a data byte
    overrides = [f"data.path={root}", "data.name=shards", "data.batch_size=16", "data.on_corrupt=skip",
                 "data.stage_dir=off", f"run.dir={tmp_path / 'run'}", "train.progress=false", "train.log_every=2"]
    summary = train(load_config(None, overrides))
    assert summary["skipped_samples"] == 1  # counted, never silent
    rows = [json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-2]["skipped_samples"] == 1 or any(r.get("skipped_samples") == 1 for r in rows)
    report = run_eval(load_config(None, overrides), tmp_path / "run" / "model.pt", tmp_path / "eval")
    assert report["count"] == 50 and report["correct"] == summary["val_correct"]
