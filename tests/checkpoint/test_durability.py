"""Durability: best.json names only committed checkpoints, the one-pass resume still
catches corruption, atomic writers fsync the parent directory. Single process."""

from __future__ import annotations

import errno
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from hpctrain.checkpoint import checksum, layout, tensorfile
from hpctrain.checkpoint.checkpointer import Checkpointer
from hpctrain.checkpoint.state import REPLICATED_TENSORS
from hpctrain.config import load_config
from hpctrain.core import atomic
from hpctrain.core.env import ClusterEnv
from hpctrain.evaluation.evaluate import write_predictions
from tests.ckpt_models import make_parts

CPU = torch.device("cpu")


def _checkpointer(run: Path, parts: Any, mode: str = "sync", *extra: str) -> Checkpointer:
    cfg = load_config(None, ["checkpoint.every_seconds=None", f"checkpoint.mode={mode}", "checkpoint.keep_last=5",
                             *extra])
    ckpt = Checkpointer(run, ClusterEnv(), CPU, cfg.checkpoint, parts.state())
    ckpt.signals.uninstall()
    return ckpt


def _best(step: int) -> dict[str, Any]:
    return {"metric": "val_accuracy", "value": 0.5 + step / 100, "step": step}


def _best_file(run: Path) -> dict[str, Any] | None:
    path = run / "checkpoints" / layout.BEST_FILE
    return json.loads(path.read_text()) if path.exists() else None


# ---------------------------------------------------------------- best.json


def test_failed_async_save_is_never_named_best(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    parts = make_parts(step=1)
    ckpt = _checkpointer(tmp_path, parts, "async")
    ckpt.save(_best(1))
    assert _best_file(tmp_path) is None  # in flight or just committed: named at the next save
    ckpt.writer.wait()  # step 1 is committed before the disk fails
    parts.counters.step = 2

    def disk_gone(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EIO, "injected: disk gone")

    monkeypatch.setattr(layout, "commit", disk_gone)
    ckpt.save(_best(2))  # waits for step 1 (committed: now named), then fails in the background
    assert _best_file(tmp_path)["checkpoint"] == "step-000000001"  # type: ignore[index]
    with pytest.raises(layout.CheckpointError, match="injected: disk gone"):
        ckpt.close()
    assert _best_file(tmp_path)["checkpoint"] == "step-000000001"  # type: ignore[index]
    assert "checkpoint" not in ckpt.best_record(_best(2))  # the summary does not name it either
    assert [s for s, _ in layout.committed(tmp_path / "checkpoints")] == [1]


def test_async_best_is_named_once_committed(tmp_path: Path) -> None:
    parts = make_parts(step=3)
    ckpt = _checkpointer(tmp_path, parts, "async")
    ckpt.save(_best(3))
    ckpt.close()
    assert _best_file(tmp_path)["checkpoint"] == "step-000000003"  # type: ignore[index]
    assert ckpt.best_record(_best(3))["checkpoint"] == "step-000000003"


def test_best_noted_after_an_async_save_waits_for_its_commit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    parts = make_parts(step=4)
    ckpt = _checkpointer(tmp_path, parts, "async")
    monkeypatch.setattr(layout, "commit", lambda *a, **k: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")))
    ckpt.save({})
    ckpt.note_best(_best(4))  # validation at the step of the save in flight, which then fails
    with pytest.raises(layout.CheckpointError, match="full"):
        ckpt.close()
    assert _best_file(tmp_path) is None


# ---------------------------------------------------------------- one-pass resume


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_one_pass_read_fills_live_tensors_and_catches_a_flipped_byte(tmp_path: Path) -> None:
    tensors = {"/a": torch.randn(1000), "/b": torch.arange(7, dtype=torch.int64), "/c": torch.randn(3, 5)}
    path = tmp_path / "t.safetensors"
    entry = tensorfile.write(path, tensors)
    assert entry == checksum.hash_file(path)  # the same checksum, however it is computed
    live = {k: torch.zeros_like(v) for k, v in tensors.items()}
    out = tensorfile.read(path, live, expect=entry)
    assert all(out[k].data_ptr() == live[k].data_ptr() and torch.equal(out[k], tensors[k]) for k in tensors)
    _, data_start = tensorfile.read_header(path)
    for offset in (data_start + 4 * 999, 20, data_start - 1):  # tensor bytes, header JSON, header padding
        _flip(path, offset)
        with pytest.raises(tensorfile.ChecksumError, match="does not match the manifest"):
            tensorfile.read(path, live, expect=entry)
        _flip(path, offset)
    with open(path, "ab") as fh:
        fh.write(b"x")
    with pytest.raises(tensorfile.ChecksumError, match="size"):
        tensorfile.read(path, live, expect=entry)


def test_leaves_hash_across_tensor_boundaries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Many leaves per file, leaves spanning tensors, pieces smaller than a leaf."""
    monkeypatch.setattr(checksum, "LEAF", 4096)
    monkeypatch.setattr(tensorfile, "CHUNK", 8192)  # the writer needs a multiple of 4 KiB
    tensors = {f"/t{i}": torch.randn(900 + 37 * i) for i in range(12)}
    path = tmp_path / "t.safetensors"
    entry = tensorfile.write(path, tensors)
    assert entry == checksum.hash_file(path)
    out = tensorfile.read(path, None, expect=entry)
    assert all(torch.equal(out[k], v) for k, v in tensors.items())
    _flip(path, path.stat().st_size - 3)
    with pytest.raises(tensorfile.ChecksumError):
        tensorfile.read(path, None, expect=entry)


def _save_steps(run: Path, steps: list[int]) -> dict[int, dict[str, torch.Tensor]]:
    parts = make_parts()
    ckpt = _checkpointer(run, parts)
    weights = {}
    for step in steps:
        with torch.no_grad():
            for p in parts.model.parameters():
                p.add_(float(step))
        parts.counters.step = step
        ckpt.save({})
        weights[step] = {k: v.clone() for k, v in parts.model.state_dict().items()}
    ckpt.close()
    return weights


def test_resume_falls_back_past_a_corrupt_newest_and_refuses_a_corrupt_path(tmp_path: Path) -> None:
    weights = _save_steps(tmp_path, [1, 2])
    newest = tmp_path / "checkpoints" / "step-000000002"
    _flip(newest / REPLICATED_TENSORS, (newest / REPLICATED_TENSORS).stat().st_size - 2)
    parts = make_parts(seed=5)
    ckpt = _checkpointer(tmp_path, parts)
    assert ckpt.resume("auto")
    assert ckpt.resumed_from is not None and ckpt.resumed_from.name == "step-000000001"
    assert parts.counters.step == 1
    assert all(torch.equal(parts.model.state_dict()[k], v) for k, v in weights[1].items())
    ckpt.close()
    kept = newest.with_name("superseded-step-000000002")  # set aside by the resume from step 1
    assert (kept / layout.MANIFEST).is_file()
    other = _checkpointer(tmp_path / "other", make_parts())
    with pytest.raises(layout.CheckpointError, match="superseded-step-000000002 is corrupt.*does not match the manif"):
        other.resume(str(kept))
    other.close()


def test_resume_with_every_checkpoint_corrupt_is_an_error(tmp_path: Path) -> None:
    _save_steps(tmp_path, [1, 2])
    for _, path in layout.committed(tmp_path / "checkpoints"):
        _flip(path / REPLICATED_TENSORS, (path / REPLICATED_TENSORS).stat().st_size - 2)
    ckpt = _checkpointer(tmp_path, make_parts())
    with pytest.raises(layout.CheckpointError, match="no intact checkpoint.*all 2 are corrupt"):
        ckpt.resume("auto")
    ckpt.close()


# ---------------------------------------------------------------- atomic writes


def test_atomic_writers_fsync_the_parent_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[Path] = []
    real = atomic.fsync_dir

    def recording(path: Path) -> None:
        synced.append(Path(path))
        real(path)

    monkeypatch.setattr(atomic, "fsync_dir", recording)
    atomic.write_json(tmp_path / "eval.json", {"a": 1})
    write_predictions([{"key": 0}], tmp_path / "predictions.jsonl")
    assert synced == [tmp_path, tmp_path]
    synced.clear()
    _save_steps(tmp_path / "run", [1])
    root = tmp_path / "run" / "checkpoints"
    assert root / ".partial-step-000000001" in synced  # the manifest's rename
    assert root in synced  # the checkpoint's rename


def test_predictions_are_written_whole_or_not_at_all(tmp_path: Path) -> None:
    path = tmp_path / "predictions.jsonl"
    path.write_text("old\n")
    with pytest.raises(TypeError):
        write_predictions([{"key": 0}, {"key": object()}], path)  # fails after the first row
    assert path.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["predictions.jsonl"]  # no temporary file left
