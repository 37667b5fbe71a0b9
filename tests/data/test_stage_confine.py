"""Staging and the checks that run before the loader read manifests as the loader does (issue 25, point 5).

With data.stage_dir on (the default under $SLURM_TMPDIR) node-local staging runs before the loader's
own checks, and the text-layout and foreign-tar checks run before them too: a crafted manifest
(a shard named ``../outside/x.tar``, non-UTF-8 bytes, JSON that is not an object, a FIFO or a
sparse giant in a shard's place) is refused there with one ShardError line, never followed outside
data.path or the stage directory, never a traceback or a blocking open."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from hpctrain.core.env import ClusterEnv
from hpctrain.data.errors import ShardError
from hpctrain.data.foreign import _mirror_bytes, foreign_index
from hpctrain.data.manifest import load_manifest, manifest_path
from hpctrain.data.stage import is_current, stage_shards, stage_target
from hpctrain.data.text import text_layout
from tests.data.test_shard_confine import _edit_manifest as _edit
from tests.data.test_shard_confine import _outside, _write
from tests.dist_utils import ROOT


def _stage(data: Path, stage: Path) -> Path:
    return stage_shards(data, stage, ClusterEnv(), ["train", "val"])


def test_staging_refuses_a_shard_named_outside_and_writes_nothing_outside_the_stage_dir(tmp_path):
    data, stage = _outside(tmp_path), tmp_path / "stage"
    (stage / "outside").mkdir(parents=True)  # where target/../outside/... would land
    with pytest.raises(ShardError, match=r"named '\.\./outside/train-000000\.tar', not a file name"):
        _stage(data, stage)
    assert list((stage / "outside").iterdir()) == []


@pytest.mark.parametrize("content, message", [
    (b'{"format": "hpctrain-shards", "x": "\xff\xfe"}', "not valid JSON"),
    (b"[1, 2]", "not an hpctrain shard manifest"),
    (b'{"format": "hpctrain-shards", "fields": ["npy"], "shards": "x"}', "'shards' is 'x', not a list"),
])
def test_staging_refuses_a_broken_manifest_with_a_shard_error(tmp_path, content, message):
    data = tmp_path / "data"
    _write(data)
    manifest_path(data, "train").write_bytes(content)
    with pytest.raises(ShardError, match=message):
        _stage(data, tmp_path / "stage")


def test_staging_refuses_a_shard_whose_size_differs_before_copying_it(tmp_path):
    data = tmp_path / "data"
    _write(data)
    os.truncate(data / "train-000000.tar", 2**40)  # a sparse 1 TiB file: copying it would fill the disk
    with pytest.raises(ShardError, match=r"train-000000\.tar: it is 1099511627776 bytes, the manifest says \d+"):
        _stage(data, tmp_path / "stage")


@pytest.mark.parametrize("victim", ["train-000000.tar", "train-000000.idx.json"])
def test_staging_refuses_a_fifo_instead_of_blocking_in_open(tmp_path, victim):
    data = tmp_path / "data"
    _write(data)
    fifo = data / victim
    fifo.unlink()
    os.mkfifo(fifo)
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            _stage(data, tmp_path / "stage")
        except BaseException as err:  # noqa: BLE001 (handed to the test thread)
            outcome.append(err)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(30)
    if worker.is_alive():  # the old code blocks in open(): release it so the process can end
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        worker.join(10)
        pytest.fail(f"staging blocked opening the FIFO {victim}")
    assert len(outcome) == 1 and isinstance(outcome[0], ShardError), outcome
    assert "is not a regular file" in str(outcome[0]) and victim in str(outcome[0])


@pytest.mark.parametrize("marker", [b"[]", b"\xff"])
def test_a_broken_stage_marker_means_copy_again(tmp_path, marker):
    data, stage = tmp_path / "data", tmp_path / "stage"
    _write(data)
    target = _stage(data, stage)
    assert is_current(data, target, ["train", "val"])
    (target / ".staged.json").write_bytes(marker)
    assert not is_current(data, target, ["train", "val"])
    assert _stage(data, stage) == target and is_current(data, target, ["train", "val"])


def test_a_marker_listing_a_file_outside_the_stage_dir_is_not_trusted(tmp_path):
    data, stage = tmp_path / "data", tmp_path / "stage"
    _write(data)
    target = _stage(data, stage)
    marker = json.loads((target / ".staged.json").read_text())
    outside = tmp_path / "elsewhere"
    outside.write_bytes(b"x")
    st = outside.stat()
    marker["files"] = {"../../elsewhere": {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns}}
    (target / ".staged.json").write_text(json.dumps(marker))
    assert not is_current(data, target, ["train", "val"])


def test_text_layout_refuses_a_crafted_text_manifest(tmp_path):
    data = tmp_path / "data"
    _write(data)
    _edit(data, lambda m: m.update(task="causal_lm", seq_len="64", vocab_size=256))
    with pytest.raises(ShardError, match=r"seq_len '64' and vocab_size 256 are not both positive whole numbers"):
        text_layout(data)
    _edit(data, lambda m: m.update(seq_len=64, shards=[{**m["shards"][0], "name": "../outside/x.tar"}]))
    with pytest.raises(ShardError, match=r"named '\.\./outside/x\.tar'"):
        text_layout(data)
    manifest_path(data, "train").unlink()
    os.mkfifo(manifest_path(data, "train"))
    assert text_layout(data) is None  # not opened: the loader refuses the FIFO without blocking


def test_foreign_checks_read_broken_manifests_without_a_traceback(tmp_path):
    data = tmp_path / "data"
    _write(data)
    manifest_path(data, "train").write_bytes(b"[1]")  # tars beside it: _usable reads indexed_from
    assert foreign_index(str(data), ["train", "val"]).root == data
    with pytest.raises(ShardError, match="not an hpctrain shard manifest"):
        load_manifest(data, "train")


def test_a_mirrored_manifest_is_checked_before_it_is_copied(tmp_path):
    data = _outside(tmp_path)
    with pytest.raises(ShardError, match=r"named '\.\./outside/train-000000\.tar'"):
        _mirror_bytes(manifest_path(data, "train"))


def test_training_with_staging_on_by_default_refuses_the_outside_shard_with_exit_2(tmp_path):
    """$SLURM_TMPDIR set and data.stage_dir unset: staging is the first reader of the manifest."""
    data, slurm_tmp = _outside(tmp_path), tmp_path / "slurm-tmp"
    slurm_tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    proc = subprocess.run([sys.executable, "-m", "hpctrain", "train", "data.name=shards", f"data.path={data}",
                           "model.name=tests.user_models:tiny_mlp", "train.max_steps=1", "train.progress=false",
                           f"run.dir={tmp_path / 'run'}"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env={**env, "SLURM_TMPDIR": str(slurm_tmp), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "not a file name in the data directory" in proc.stderr and "Traceback" not in proc.stderr
    assert not (stage_target(data, slurm_tmp).parent / "outside").exists()
