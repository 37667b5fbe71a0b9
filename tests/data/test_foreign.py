"""Tars written by other tools (webdataset.ShardWriter, GNU tar) used directly as data.path,
and node-local staging that fails fast and durably (issue 8, points 3, 5 and 6)."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from hpctrain.core.env import ClusterEnv
from hpctrain.core.errors import HpctrainError
from hpctrain.data.errors import ShardError
from hpctrain.data.foreign import expand_braces, prepare
from hpctrain.data.loader import ShardedLoader
from hpctrain.data.manifest import manifest_path
from hpctrain.data.shard_index import ShardIndex
from tests.data.test_shards import make_shards
from tests.dist_utils import run_ranks

LONG = "x" * 110  # a key longer than USTAR's 100-character name: the writer must use a PAX header


def images(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, 28, 28), dtype=np.uint8), rng.integers(0, 10, n)


def png(pixels: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def shardwriter_tars(root: Path, split: str, n: int, per_shard: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """PAX tars from webdataset.ShardWriter, as users make them."""
    import webdataset as wds

    x, y = images(n, seed)
    root.mkdir(parents=True, exist_ok=True)
    with wds.ShardWriter(str(root / f"{split}-%06d.tar"), maxcount=per_shard, verbose=0) as sink:
        for i in range(n):
            sink.write({"__key__": f"{LONG}{split}{i:05d}", "png": png(x[i]), "cls": int(y[i])})
    return x, y


def gnu_tar(root: Path, name: str, x: np.ndarray, y: np.ndarray, label: str = "cls") -> None:
    """A tar made by the `tar` command from loose files (<key>.png + <key>.cls or .json)."""
    files = root / f"loose-{name}"
    files.mkdir(parents=True)
    for i in range(len(y)):
        (files / f"s{i:04d}.png").write_bytes(png(x[i]))
        data = str(int(y[i])) if label == "cls" else json.dumps({"label": int(y[i]), "note": "x"})
        (files / f"s{i:04d}.{label}").write_text(data)
    names = sorted(p.name for p in files.iterdir())
    subprocess.run(["tar", "cf", str(root / name), "-C", str(files), *names], check=True)


def read_all(root: Path, split: str = "train") -> dict[str, tuple[np.ndarray, int]]:
    loader = ShardedLoader(root, ClusterEnv(), 4, split=split, shuffle="none", drop_last=False)
    out = {}
    for batch in loader:
        for key, x, t in zip(batch.keys, batch.inputs, batch.targets):
            if key:
                out[key] = (np.rint(x[0].numpy() * 255).astype(np.uint8), int(t))
    return out


def test_shardwriter_pax_tars_index_on_first_use_and_read_back(tmp_path, caplog):
    x, y = shardwriter_tars(tmp_path / "wds", "train", 10, per_shard=4)
    shardwriter_tars(tmp_path / "wds", "val", 5, per_shard=5, seed=1)
    with caplog.at_level(logging.INFO, "hpctrain"):
        root = prepare(str(tmp_path / "wds"), ["train", "val"], ClusterEnv())
    assert root == tmp_path / "wds" and manifest_path(root, "val").is_file()
    lines = [r.message for r in caplog.records if "on first use" in r.message]
    assert len(lines) == 1 and "train: 3 tars, 10 samples" in lines[0] and "val: 1 tars, 5 samples" in lines[0]
    got = read_all(root)
    assert len(got) == 10
    for i in range(10):
        pixels, label = got[f"{LONG}train{i:05d}"]
        assert label == y[i] and np.array_equal(pixels, x[i])
    caplog.clear()
    with caplog.at_level(logging.INFO, "hpctrain"):  # the second run reuses the index
        assert prepare(str(tmp_path / "wds"), ["train", "val"], ClusterEnv()) == root
    assert not [r for r in caplog.records if "on first use" in r.message]


def test_gnu_tar_with_json_labels_and_a_changed_tar_is_reindexed(tmp_path):
    x, y = images(6, 3)
    gnu_tar(tmp_path / "d", "train-0.tar", x, y, label="json")
    root = prepare(str(tmp_path / "d"), ["train", "val"], ClusterEnv())
    manifest = json.loads(manifest_path(root, "train").read_text())
    assert manifest["decode"]["target"] == "json" and manifest["decode"]["target_key"] == "label"
    got = read_all(root)
    assert [got[f"s{i:04d}"][1] for i in range(6)] == list(y)
    assert np.array_equal(got["s0002"][0], x[2])
    x2, y2 = images(7, 4)  # the tar is rewritten: the stale index must not be used
    (tmp_path / "d" / "train-0.tar").unlink()
    os.rename(tmp_path / "d" / "loose-train-0.tar", tmp_path / "old")
    gnu_tar(tmp_path / "d", "train-0.tar", x2, y2, label="cls")
    assert len(ShardIndex(prepare(str(tmp_path / "d"), ["train"], ClusterEnv()), "train")) == 7


def test_read_only_directory_indexes_into_the_cache_and_stages(tmp_path, monkeypatch):
    x, y = shardwriter_tars(tmp_path / "ro", "train", 8, per_shard=4)
    monkeypatch.setenv("HPCTRAIN_CACHE", str(tmp_path / "cache"))
    before = sorted(os.listdir(tmp_path / "ro"))
    os.chmod(tmp_path / "ro", 0o555)  # read-only for its owner; root could still write, but must not
    try:
        root = prepare(str(tmp_path / "ro"), ["train", "val"], ClusterEnv())
        assert sorted(os.listdir(tmp_path / "ro")) == before
        assert root.parent == tmp_path / "cache" / "index"
        assert json.loads(manifest_path(root, "train").read_text())["data_dir"] == str((tmp_path / "ro").resolve())
        assert len(read_all(root)) == 8
        from hpctrain.data.stage import stage_shards

        staged = stage_shards(root, tmp_path / "local", ClusterEnv(), ["train", "val"])
        assert (staged / "train-000000.tar").is_file()
        assert "data_dir" not in json.loads(manifest_path(staged, "train").read_text())
        assert {k: v[1] for k, v in read_all(staged).items()} == {f"{LONG}train{i:05d}": y[i] for i in range(8)}
    finally:
        os.chmod(tmp_path / "ro", 0o755)


def test_brace_patterns(tmp_path):
    assert expand_braces("a-{000..002}.tar") == ["a-000.tar", "a-001.tar", "a-002.tar"]
    assert expand_braces("{x,y}-{8..10}") == ["x-8", "x-9", "x-10", "y-8", "y-9", "y-10"]
    shardwriter_tars(tmp_path / "p", "train", 12, per_shard=3)
    shardwriter_tars(tmp_path / "p", "val", 3, per_shard=3, seed=1)
    root = prepare(str(tmp_path / "p" / "train-{000001..000002}.tar"), ["train", "val"], ClusterEnv())
    assert root.parent == tmp_path / "p" and root.name.startswith(".hpctrain-index-")
    assert sorted(read_all(root)) == [f"{LONG}train{i:05d}" for i in range(3, 9)]
    assert len(ShardIndex(root, "val")) == 3  # the other split is found beside the pattern
    assert not manifest_path(tmp_path / "p", "train").exists()  # a subset is not written as the whole split
    with pytest.raises(ShardError, match=r"1 of 3 files do not exist.*train-000004.tar"):
        prepare(str(tmp_path / "p" / "train-{000002..000004}.tar"), ["train"], ClusterEnv())


def test_unclear_split_or_label_is_a_user_error_naming_the_directory(tmp_path):
    x, y = images(3, 0)
    gnu_tar(tmp_path / "a", "shard-0.tar", x, y)
    with pytest.raises(ShardError, match=rf"cannot tell which tars in {tmp_path / 'a'} hold the train split.*hint"):
        prepare(str(tmp_path / "a"), ["train", "val"], ClusterEnv())
    gnu_tar(tmp_path / "b", "train-0.tar", x, y, label="txt")  # a .txt is not a label
    with pytest.raises(ShardError, match=rf"cannot find a label in the samples of {tmp_path / 'b'}.*\.cls"):
        prepare(str(tmp_path / "b"), ["train"], ClusterEnv())
    assert not manifest_path(tmp_path / "b", "train").exists()
    with pytest.raises(ShardError, match="does not exist"):
        prepare(str(tmp_path / "nope"), ["train"], ClusterEnv())


def _prepare_rank(env: ClusterEnv, path: str) -> tuple[str, int]:
    root = prepare(path, ["train", "val"], env)
    return str(root), len(ShardIndex(root, "train"))


def test_two_ranks_index_once_and_agree(tmp_path):
    shardwriter_tars(tmp_path / "w", "train", 9, per_shard=3)
    results = run_ranks(2, _prepare_rank, str(tmp_path / "w"))
    assert results == [(str(tmp_path / "w"), 9)] * 2


def test_train_from_shardwriter_tars(tmp_path):
    from hpctrain.config import load_config
    from hpctrain.train import train

    shardwriter_tars(tmp_path / "wds", "train", 64, per_shard=32)
    shardwriter_tars(tmp_path / "wds", "val", 16, per_shard=16, seed=1)
    cfg = load_config(None, [f"data.path={tmp_path / 'wds'}", "data.name=shards", "data.batch_size=16",
                             f"run.dir={tmp_path / 'run'}", "train.progress=false", "train.epochs=1",
                             "data.stage_dir=off"])
    summary = train(cfg)
    assert summary["steps"] == 4 and summary["val_count"] == 16


# ---------------------------------------------------------------- staging (points 5 and 6)


# A waiter that missed local rank 0's failure would wait this long and then fail with
# NodeWaitTimeout instead of PeerError: far past a fault-free staging of two small shards on a
# machine many times slower than this one, far below the hour a real job waits.
WAIT_S = 300


def _stage_rank(env: ClusterEnv, source: str, stage: str) -> tuple[str, str]:
    from hpctrain.data.stage import stage_shards

    try:
        stage_shards(Path(source), Path(stage), env, ["train"], timeout_s=WAIT_S)
    except HpctrainError as err:
        return type(err).__name__, str(err)
    return "ok", ""


def test_a_failed_staging_copy_stops_every_local_rank_with_its_message(tmp_path):
    src = make_shards(tmp_path / "src", n=10, per_shard=5)
    with open(src / "train-000001.tar", "r+b") as fh:  # same size, other bytes: the sha256 check fails
        fh.seek(700)
        fh.write(b"\x01")
    # The waiters' own timeout ends a lost failure first (as NodeWaitTimeout); this bound only
    # catches a hang of the whole group (spawn, gloo, a collective), whatever the machine's speed.
    results = run_ranks(3, _stage_rank, str(src), str(tmp_path / "local"), timeout=3 * WAIT_S)
    kinds, messages = zip(*results)
    assert kinds == ("StageError", "PeerError", "PeerError")  # the waiters learned of it, did not time out
    assert "train-000001.tar" in messages[0] and "sha256" in messages[0]
    assert messages[1] == messages[2] == messages[0]  # the waiting ranks fail with local rank 0's message


def test_staged_copy_is_trusted_only_when_its_marker_matches(tmp_path):
    from hpctrain.data.stage import is_current, stage_shards

    src = make_shards(tmp_path / "src", n=10, per_shard=5)
    target = stage_shards(src, tmp_path / "local", ClusterEnv(), ["train"])
    marker = json.loads((target / ".staged.json").read_text())
    shard = marker["files"]["train-000000.tar"]
    assert len(shard["sha256"]) == 64 and shard["bytes"] == (target / "train-000000.tar").stat().st_size
    assert is_current(src, target, ["train"])
    with open(target / "train-000000.tar", "r+b") as fh:  # same size, changed after staging
        fh.seek(700)
        fh.write(b"\x02")
    assert not is_current(src, target, ["train"])
    stage_shards(src, tmp_path / "local", ClusterEnv(), ["train"])  # copied again, verified
    assert is_current(src, target, ["train"])
    assert (target / "train-000000.tar").read_bytes() == (src / "train-000000.tar").read_bytes()
