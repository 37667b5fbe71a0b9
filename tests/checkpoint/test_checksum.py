"""checkpoint.hash: xxh3 (default), crc32 or sha256; the manifest names the algorithm; every flipped
byte is caught by each; checkpoints of any algorithm (and the sha256 ones written before the
choice existed) verify and resume; a missing xxhash is a clear error, never "corrupt". Single process."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from hpctrain.checkpoint import checksum, layout, tensorfile
from hpctrain.checkpoint.checkpointer import Checkpointer
from hpctrain.checkpoint.state import REPLICATED, REPLICATED_TENSORS, rank_file
from hpctrain.cli import main as cli_main
from hpctrain.config import ConfigError, load_config
from hpctrain.core.env import ClusterEnv
from tests.ckpt_models import make_parts

CPU = torch.device("cpu")
ALGORITHMS = ["xxh3", "crc32", "sha256"]


@pytest.fixture(params=ALGORITHMS)
def algorithm(request: pytest.FixtureRequest) -> checksum.Algorithm:
    if request.param == "xxh3":
        pytest.importorskip("xxhash")
    return checksum.ALGORITHMS[request.param]


def _checkpointer(run: Path, parts: Any, *extra: str) -> Checkpointer:
    cfg = load_config(None, ["checkpoint.every_seconds=None", "checkpoint.keep_last=5", *extra])
    ckpt = Checkpointer(run, ClusterEnv(), CPU, cfg.checkpoint, parts.state())
    ckpt.signals.uninstall()
    return ckpt


def _save(run: Path, hash_name: str, steps: tuple[int, ...] = (1,)) -> dict[str, torch.Tensor]:
    """Checkpoints of ``steps`` written with checkpoint.hash=hash_name; the weights of the last."""
    parts = make_parts()
    ckpt = _checkpointer(run, parts, f"checkpoint.hash={hash_name}")
    for step in steps:
        parts.counters.step = step
        ckpt.save({})
    ckpt.close()
    return {k: v.clone() for k, v in parts.model.state_dict().items()}


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _tree(path: Path, new: Any, leaf: int) -> str:
    """The documented tree checksum, computed here independently of hpctrain."""
    data = path.read_bytes()
    pieces = [data[i : i + leaf] for i in range(0, len(data), leaf)] or [b""]
    leaves = b"".join(new(piece).digest() for piece in pieces)
    return new(leaves).hexdigest()


def _reference(name: str) -> Any:
    if name == "xxh3":
        import xxhash

        return xxhash.xxh3_128
    if name == "crc32":
        import zlib

        class Crc:  # hashlib's interface over zlib.crc32, as the docs describe it
            def __init__(self, data: bytes) -> None:
                self.value = zlib.crc32(data)

            def digest(self) -> bytes:
                return self.value.to_bytes(4, "big")

            def hexdigest(self) -> str:
                return self.digest().hex()

        return Crc
    return hashlib.sha256


# ---------------------------------------------------------------- the tensor file, byte by byte


def test_a_flipped_byte_anywhere_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           algorithm: checksum.Algorithm) -> None:
    """Several leaves (4 KiB here), leaves spanning tensors; a byte flipped in the length prefix,
    the header, its padding, the first and last data bytes and on both sides of a leaf boundary."""
    monkeypatch.setattr(checksum, "LEAF", 4096)
    monkeypatch.setattr(tensorfile, "CHUNK", 8192)  # the writer needs a multiple of 4 KiB
    tensors = {f"/t{i}": torch.randn(700 + 53 * i) for i in range(6)}
    path = tmp_path / "t.safetensors"
    entry = tensorfile.write(path, tensors, algorithm)
    assert set(entry) == {"size", algorithm.key}
    assert entry == checksum.hash_file(path, algorithm)  # however it is computed
    assert entry[algorithm.key] == _tree(path, _reference(algorithm.name), 4096)  # as documented
    _, start = tensorfile.read_header(path)
    size = path.stat().st_size
    offsets = [0, 9, start - 1, start, start + 4095, start + 4096, size // 2, size - 1]
    live = {k: torch.zeros_like(v) for k, v in tensors.items()}
    for offset in offsets:
        _flip(path, offset)
        with pytest.raises(tensorfile.ChecksumError, match="does not match the manifest"):
            tensorfile.read(path, live, expect=entry)
        _flip(path, offset)
    out = tensorfile.read(path, live, expect=entry)  # every flip undone: intact again
    assert all(torch.equal(out[k], v) and out[k].data_ptr() == live[k].data_ptr() for k, v in tensors.items())


# ---------------------------------------------------------------- whole checkpoints


def test_the_manifest_names_the_algorithm_and_verify_catches_every_file(tmp_path: Path,
                                                                        algorithm: checksum.Algorithm) -> None:
    _save(tmp_path, algorithm.name)
    ckpt = tmp_path / "checkpoints" / "step-000000001"
    manifest = layout.read_manifest(ckpt)
    assert {checksum.of_entry(e) for e in manifest["files"].values()} == {algorithm}
    assert manifest["checksum"] == algorithm.doc
    assert layout.verify(ckpt) == []
    for name in (REPLICATED_TENSORS, REPLICATED, rank_file(0)):
        file = ckpt / name
        _flip(file, file.stat().st_size // 2)
        assert layout.verify(ckpt) == [f"{file}: checksum ({algorithm.key}) does not match the manifest (corrupted)"]
        _flip(file, file.stat().st_size // 2)


def test_a_corrupt_newest_is_skipped_whatever_the_algorithm(tmp_path: Path, algorithm: checksum.Algorithm) -> None:
    _save(tmp_path, algorithm.name, (1, 2))
    newest = tmp_path / "checkpoints" / "step-000000002"
    _flip(newest / REPLICATED_TENSORS, (newest / REPLICATED_TENSORS).stat().st_size - 5)
    ckpt = _checkpointer(tmp_path, make_parts(seed=3))  # the default hash reads any algorithm's checkpoint
    assert ckpt.resume("auto")
    assert ckpt.resumed_from is not None and ckpt.resumed_from.name == "step-000000001"
    ckpt.close()


def test_sha256_checkpoints_of_earlier_versions_resume_under_the_fast_default(tmp_path: Path) -> None:
    """An sha256 manifest is exactly what hpctrain wrote before checkpoint.hash existed: the key
    sha256_tree and the sha256 tree of 64 MiB pieces. A run with the default hash resumes from
    it, and its next checkpoint uses the default."""
    weights = _save(tmp_path, "sha256")
    ckpt_dir = tmp_path / "checkpoints" / "step-000000001"
    files = layout.read_manifest(ckpt_dir)["files"]
    for name, entry in files.items():
        assert set(entry) == {"size", "sha256_tree"}
        assert entry["sha256_tree"] == _tree(ckpt_dir / name, hashlib.sha256, 64 << 20)
    parts = make_parts(seed=7)
    ckpt = _checkpointer(tmp_path, parts)
    assert ckpt.resume("auto") and parts.counters.step == 1
    assert all(torch.equal(parts.model.state_dict()[k], v) for k, v in weights.items())
    parts.counters.step = 2
    ckpt.save({})
    ckpt.close()
    default = checksum.resolve(checksum.DEFAULT)
    newer = layout.read_manifest(tmp_path / "checkpoints" / "step-000000002")["files"]
    assert {checksum.of_entry(e) for e in newer.values()} == {default}


def test_an_unknown_checksum_key_is_a_problem_not_a_pass(tmp_path: Path) -> None:
    _save(tmp_path, "crc32")
    ckpt = tmp_path / "checkpoints" / "step-000000001"
    manifest = json.loads((ckpt / layout.MANIFEST).read_text())
    entry = manifest["files"][REPLICATED]
    entry["md5_tree"] = entry.pop("crc32_tree")
    (ckpt / layout.MANIFEST).write_text(json.dumps(manifest))
    problems = layout.verify(ckpt)
    assert problems == [f"{ckpt / REPLICATED}: its manifest entry holds no checksum this version knows (one of "
                        "xxh3_128_tree, crc32_tree, sha256_tree) (corrupted, or written by a newer hpctrain)"]
    with pytest.raises(layout.CheckpointError, match="no checksum this version knows"):
        _checkpointer(tmp_path, make_parts()).resume(str(ckpt))


def test_a_bad_hash_name_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="checkpoint.hash='md5' is not allowed; choose one of: xxh3, crc32, sha256"):
        load_config(None, ["checkpoint.hash=md5"])


# ---------------------------------------------------------------- without the xxhash package


def test_without_xxhash_saves_use_crc32_and_xxh3_checkpoints_are_unverifiable_not_corrupt(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("xxhash")
    _save(tmp_path / "xxh3", "xxh3")
    written = tmp_path / "xxh3" / "checkpoints" / "step-000000001"
    monkeypatch.setitem(sys.modules, "xxhash", None)  # `import xxhash` now fails
    monkeypatch.setattr(checksum, "_warned", set())
    _save(tmp_path / "fallback", "xxh3")
    assert "the xxhash package is not installed, checkpoints are checksummed with crc32" in caplog.text
    files = layout.read_manifest(tmp_path / "fallback" / "checkpoints" / "step-000000001")["files"]
    assert {checksum.of_entry(e) for e in files.values()} == {checksum.ALGORITHMS["crc32"]}
    with pytest.raises(layout.UnreadableCheckpointError, match="cannot be verified here.*pip install xxhash") as info:
        layout.verify(written)
    assert info.value.exit_code == 2
    capsys.readouterr()
    assert cli_main(["ckpt", "verify", str(written)]) == 2
    out = capsys.readouterr().out
    assert "UNREADABLE" in out and "pip install xxhash" in out and "CORRUPT" not in out
    with pytest.raises(checksum.ChecksumUnavailableError, match="pip install xxhash") as raised:
        _checkpointer(tmp_path / "xxh3", make_parts()).resume("auto")  # not skipped as corrupt
    assert raised.value.exit_code == 2
    assert (written / layout.MANIFEST).is_file()  # nothing set aside
