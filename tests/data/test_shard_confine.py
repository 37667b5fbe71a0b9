"""Shard input is read only where it was given and only by checked ranges (issue 25, point 5): a
manifest naming ``../../outside.tar`` (or an index or ``data_dir`` elsewhere) is refused by the
loader, by training and by ``hpctrain data verify``; an index with a negative byte range and a tar
member declaring 100 GB are clean ShardErrors, not ``OSError``/``MemoryError``; FIFOs never block."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

from hpctrain.cli import main
from hpctrain.core.env import ClusterEnv
from hpctrain.data.errors import CorruptSampleError, ShardError
from hpctrain.data.indexing import index_existing, index_tar
from hpctrain.data.loader import ShardedLoader
from hpctrain.data.manifest import manifest_path
from hpctrain.data.pack import cls_bytes, npy_bytes
from hpctrain.data.shard_dataset import ShardDataset
from hpctrain.data.shard_index import ShardIndex
from hpctrain.data.verify import verify
from hpctrain.data.writer import write_shards
from tests.dist_utils import ROOT


def _write(root: Path, split: str = "train", n: int = 8) -> dict:
    samples = ((f"s{i:04d}", {"npy": npy_bytes(np.full(4, i, np.float32)), "cls": cls_bytes(i % 2)}) for i in range(n))
    return write_shards(samples, root, split, samples_per_shard=4)


def _edit_manifest(root: Path, change, split: str = "train") -> None:
    path = manifest_path(root, split)
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


def _outside(tmp_path: Path) -> Path:
    """data/ whose manifest names ../outside/train-000000.tar, a valid shard outside data/."""
    _write(tmp_path / "outside")
    data = tmp_path / "data"
    _write(data)
    (data / "train-000000.tar").unlink()
    _edit_manifest(data, lambda m: m["shards"][0].update(name="../outside/train-000000.tar"))
    return data


def _verify_cli(capsys: pytest.CaptureFixture[str], root: Path) -> tuple[int, str]:
    code = main(["data", "verify", str(root)])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_a_shard_named_outside_the_data_directory_is_refused_by_loader_and_verify(tmp_path, capsys):
    data = _outside(tmp_path)
    with pytest.raises(ShardError, match=r"named '\.\./outside/train-000000\.tar', not a file name"):
        ShardIndex(data, "train")
    code, out = _verify_cli(capsys, data)
    assert code == 2 and "../outside/train-000000.tar" in out and "ok" not in out and "Traceback" not in out


def test_training_refuses_the_outside_shard_with_exit_2(tmp_path):
    data = _outside(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "hpctrain", "train", "data.name=shards", f"data.path={data}",
                           "model.name=tests.user_models:tiny_mlp", "train.max_steps=1", "train.progress=false",
                           "data.stage_dir=off", f"run.dir={tmp_path / 'run'}"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "not a file name in the data directory" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("change, culprit", [
    (lambda m: m["shards"][0].update(index="/etc/passwd"), "index '/etc/passwd' is not a file name"),
    (lambda m: m["shards"][0].update(index="../x.idx.json"), "index '../x.idx.json' is not a file name"),
    (lambda m: m.update(data_dir="/etc"), "'data_dir' '/etc' sends the reader outside"),
    (lambda m: m["shards"][0].update(name="/tmp/x.tar"), "named '/tmp/x.tar', not a file name"),
    (lambda m: m["shards"][0].update(samples="4"), "'samples' is '4', not a count"),
    (lambda m: m.update(shards={"a": 1}), "'shards' is {'a': 1}, not a list"),
])
def test_manifest_paths_and_types_are_checked(tmp_path, change, culprit):
    _write(tmp_path)
    _edit_manifest(tmp_path, change)
    with pytest.raises(ShardError, match="hint:") as err:
        ShardIndex(tmp_path, "train")
    assert culprit in str(err.value)


def _edit_index(root: Path, change) -> None:
    path = root / "train-000000.idx.json"
    index = json.loads(path.read_text())
    change(index)
    path.write_text(json.dumps(index))


def test_a_negative_byte_range_is_a_clean_error_in_the_loader_and_a_verify_failure(tmp_path, capsys):
    _write(tmp_path)

    def swap(ix: dict) -> None:  # sample 1 ends before it starts: pread(fd, negative, ...) was EINVAL
        ix["start"][1], ix["end"][1] = ix["end"][1], ix["start"][1]
    _edit_index(tmp_path, swap)
    with pytest.raises(ShardError, match=r"sample 's0001' \(bytes \d+\.\.\d+\) ends before it starts"):
        ShardIndex(tmp_path, "train")
    problems = verify(tmp_path, "train")
    assert len(problems) == 1 and "ends before it starts" in str(problems[0])
    code, out = _verify_cli(capsys, tmp_path)
    assert code == 1 and "FAIL train: train-000000.tar" in out and "Traceback" not in out


@pytest.mark.parametrize("change, culprit", [
    (lambda ix: ix["start"].__setitem__(0, -512), "starts before the file"),
    (lambda ix: ix["end"].__setitem__(3, 2**40), "ends past the"),
    (lambda ix: ix["offsets"][0].__setitem__(1, 2**40), "lie outside its"),
    (lambda ix: ix["offsets"][0].__setitem__(0, 3), "lie outside its"),
    (lambda ix: ix["crc32"].__setitem__(0, 1.5), "'crc32' is not a list of 4 whole numbers"),
    (lambda ix: ix.update(fields=["cls", "npy"]), "differ from the manifest's"),
])
def test_index_ranges_and_types_are_checked_before_reading(tmp_path, change, culprit):
    _write(tmp_path)
    _edit_index(tmp_path, change)
    with pytest.raises(ShardError) as err:
        ShardIndex(tmp_path, "train")
    assert culprit in str(err.value)


def test_a_range_past_the_end_under_skip_reads_only_what_is_there(tmp_path):
    """Manifest and index agree on a 1 TiB shard the file is not: its last sample is skipped, and
    the read never asks for (allocates) the bytes the index claims."""
    _write(tmp_path)
    _edit_manifest(tmp_path, lambda m: m["shards"][0].update(bytes=2**40))
    _edit_index(tmp_path, lambda ix: ix["end"].__setitem__(3, 2**40))
    loader = ShardedLoader(tmp_path, ClusterEnv(), 4, on_corrupt="skip", shuffle="none")
    masks = [b.mask.tolist() if b.mask is not None else [True] * 4 for b in loader]
    assert masks == [[True, True, True, False], [True] * 4] and loader.skipped_keys == ["s0003"]


def _tar_with_member(path: Path, declared: int) -> None:
    """A one-sample tar whose .cls header declares ``declared`` bytes (the file holds one)."""
    def header(name: str, size: int) -> bytes:
        info = tarfile.TarInfo(name)
        info.size = size
        return info.tobuf(tarfile.GNU_FORMAT)
    body = npy_bytes(np.zeros(4, np.float32))
    path.write_bytes(header("a.npy", len(body)) + body + b"\0" * (-len(body) % 512)
                     + header("a.cls", declared) + b"3" + b"\0" * 511 + b"\0" * 1024)


def test_a_member_declaring_100_gb_is_refused_before_it_is_read(tmp_path, capsys):
    _tar_with_member(tmp_path / "train-0.tar", 100 * 2**30)
    declared = r"member 'a\.cls' declares 107374182400 bytes .* past the end of the file"
    with pytest.raises(ShardError, match=declared) as err:
        index_tar(tmp_path / "train-0.tar")
    assert str(err.value).count("hint:") == 1, err.value  # one message, not re-wrapped with a second hint
    code = main(["data", "index", str(tmp_path), "--split", "train"])
    assert code == 2 and "107374182400" in capsys.readouterr().err
    assert not manifest_path(tmp_path, "train").exists()


def test_an_honest_member_is_still_indexed(tmp_path):
    _tar_with_member(tmp_path / "train-0.tar", 1)
    manifest = index_existing(tmp_path, "train")
    assert manifest["total_samples"] == 1 and manifest["decode"]["target"] == "cls"
    assert ShardDataset(ShardIndex(tmp_path, "train")).read(0)["cls"] == 3


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs")
def test_fifos_in_place_of_shards_indexes_and_tars_never_block(tmp_path):
    _write(tmp_path)
    (tmp_path / "train-000001.idx.json").unlink()
    os.mkfifo(tmp_path / "train-000001.idx.json")
    with pytest.raises(ShardError, match="not a regular file"):
        ShardIndex(tmp_path, "train")
    (tmp_path / "train-000001.tar").unlink()
    os.mkfifo(tmp_path / "train-000001.tar")
    with pytest.raises(ShardError, match="not a regular file"):
        ShardIndex(tmp_path, "train")
    assert "not a regular file" in str(verify(tmp_path, "train")[0])
    os.mkfifo(tmp_path / "other-0.tar")
    with pytest.raises(ShardError, match="not a regular file"):
        index_tar(tmp_path / "other-0.tar")


def test_a_record_without_its_label_is_a_bad_sample_and_a_missing_label_field_is_refused(tmp_path):
    records = [{"label": 1}, {"other": 2}, {"label": 0}, {"label": "x"}]
    samples = ((f"r{i}", {"npy": npy_bytes(np.zeros(2, np.float32)), "json": json.dumps(r).encode()})
               for i, r in enumerate(records))
    write_shards(samples, tmp_path, "train", meta={"decode": {"input": "npy", "target": "json", "target_key": "label"}})
    with pytest.raises(CorruptSampleError, match=r"sample 'r1': no class label \(KeyError"):
        ShardDataset(ShardIndex(tmp_path, "train")).batch([0, 1])
    batch = ShardDataset(ShardIndex(tmp_path, "train"), on_corrupt="skip").batch([0, 1, 2, 3])
    assert batch.mask.tolist() == [True, False, True, False] and batch.targets.tolist()[::2] == [1, 0]
    _edit_manifest(tmp_path, lambda m: m["decode"].update(target="cls"))
    with pytest.raises(ShardError, match="label field 'cls'"):
        ShardDataset(ShardIndex(tmp_path, "train"))
