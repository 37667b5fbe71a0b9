"""What killed saves and partial copies leave never blocks a save; unreadable is not corrupt;
the two-tier checkpoint's node-local tier is pruned, named in hints, and read on restart
(issue 17, points 4 and 6, and the leftovers of point 5). Single process, tiny model."""

from __future__ import annotations

import datetime
import errno
import logging
import os
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from hpctrain.checkpoint import checksum, layout, tensorfile
from hpctrain.checkpoint.checkpointer import Checkpointer
from hpctrain.checkpoint.state import REPLICATED_TENSORS, snapshot
from hpctrain.checkpoint.writer import CheckpointWriter, _local_root, default_group
from hpctrain.cli import main as cli_main
from hpctrain.config import load_config
from hpctrain.core.env import ClusterEnv
from hpctrain.train import train
from tests.ckpt_models import make_parts

BASE = ["model.name=tests.ckpt_models:tiny_mlp", "data.name=synthetic_tiny", "data.synthetic_size=128",
        "data.batch_size=16", "data.max_val_samples=32", "train.epochs=1", "train.progress=false",
        "checkpoint.every_seconds=None", "train.threads=1", "optim.schedule=constant"]
CPU = torch.device("cpu")


def _train(run: Path, *extra: str) -> dict:
    return train(load_config(None, [*BASE, f"run.dir={run}", *extra]))


def _steps(run: Path) -> list[int]:
    return [s for s, _ in layout.committed(run / "checkpoints")]


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """A finished run with checkpoints at steps 4 and 8, and its summary."""
    run = tmp_path_factory.mktemp("leftovers") / "run"
    return run, _train(run, "checkpoint.every_steps=4")


# ---------------------------------------------------------------- leftovers in the way


def test_a_run_whose_manifests_were_deleted_starts_over_and_saves(reference: tuple[Path, dict], tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """A partial rsync or a clean-up script deleted every manifest: the run starts over (nothing
    is committed), and the step directories in its way are kept aside, not an error. What killed
    writes left (temporary files of dead processes, partial saves) is removed at the start."""
    run = tmp_path / "run"
    shutil.copytree(reference[0], run)
    (run / "summary.json").unlink()  # as if killed
    for _, path in layout.committed(run / "checkpoints"):
        (path / layout.MANIFEST).unlink()
    dead, alive = _dead_pid(), os.getppid()  # alive: another process may be writing it
    stale = [run / f".model.pt.tmp-{dead}", run / "checkpoints" / f".best.json.tmp-{dead}"]
    for path in [*stale, run / f".model.pt.tmp-{alive}"]:
        path.write_bytes(b"half")
    (run / "checkpoints" / ".partial-step-000000012").mkdir()
    with caplog.at_level(logging.INFO, "hpctrain"):
        summary = _train(run, "checkpoint.every_steps=4", "resume=auto")
    assert summary["steps"] == 8 and summary["params_sha256"] == reference[1]["params_sha256"]
    assert _steps(run) == [4, 8]
    for step in (4, 8):
        aside = run / "checkpoints" / f"uncommitted-step-{step:09d}"
        assert (aside / REPLICATED_TENSORS).is_file()  # kept, not deleted
        assert f"step-{step:09d} is in the way (it has no manifest" in caplog.text
    assert not any(path.exists() for path in stale) and (run / f".model.pt.tmp-{alive}").exists()
    assert not (run / "checkpoints" / ".partial-step-000000012").exists()
    assert f".model.pt.tmp-{dead}, left by a write that was interrupted" in caplog.text
    assert ".partial-step-000000012, left by an interrupted save" in caplog.text


def test_export_removes_the_temporary_file_a_killed_export_left(reference: tuple[Path, dict], tmp_path: Path) -> None:
    stale = tmp_path / f".w.safetensors.tmp-{_dead_pid()}"
    stale.write_bytes(b"half")
    assert cli_main(["ckpt", "export", str(reference[0]), str(tmp_path / "w.safetensors")]) == 0
    assert not stale.exists() and (tmp_path / "w.safetensors").is_file()


# ---------------------------------------------------------------- unreadable is not corrupt


def _checkpointer(run: Path, parts: object, *extra: str) -> Checkpointer:
    cfg = load_config(None, ["checkpoint.every_seconds=None", *extra])
    ckpt = Checkpointer(run, ClusterEnv(), CPU, cfg.checkpoint, parts.state())  # type: ignore[attr-defined]
    ckpt.signals.uninstall()
    return ckpt


def _denied(path: Path) -> PermissionError:
    return PermissionError(errno.EACCES, "Permission denied", str(path))


@pytest.mark.parametrize("what", ["manifest", "tensor bytes"])
def test_an_unreadable_checkpoint_is_reported_as_such_never_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str],
                                                                    what: str) -> None:
    """Tests run as root, whom chmod does not stop: the reads fail with EACCES by monkeypatch."""
    parts = make_parts(step=1)
    ckpt = _checkpointer(tmp_path, parts)
    ckpt.save({}, blocking=True)
    parts.counters.step = 2
    ckpt.save({}, blocking=True)
    ckpt.close()
    newest = tmp_path / "checkpoints" / "step-000000002"
    blocked = newest / (layout.MANIFEST if what == "manifest" else REPLICATED_TENSORS)
    if what == "manifest":
        read_text = Path.read_text
        monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: (_ for _ in ()).throw(_denied(self))
                            if self == blocked else read_text(self, *a, **k))
    else:
        open_read = tensorfile._open_read
        monkeypatch.setattr(tensorfile, "_open_read", lambda path: (_ for _ in ()).throw(_denied(path))
                            if path == blocked else open_read(path))
        hash_file = checksum.hash_file
        monkeypatch.setattr(checksum, "hash_file", lambda path, *a: (_ for _ in ()).throw(_denied(path))
                            if path == blocked else hash_file(path, *a))
    with pytest.raises(layout.UnreadableCheckpointError) as info:
        _checkpointer(tmp_path, make_parts(seed=1)).resume("auto")
    message = str(info.value)
    assert str(blocked) in message and "Permission denied" in message and "unreadable" in message
    assert "corrupt" not in message and "overwrite" not in message and "delete" not in message
    assert info.value.exit_code == 2  # fix the permissions (an I/O error of the disk: 1)
    assert _steps(tmp_path) == [1, 2]  # nothing set aside
    capsys.readouterr()
    assert cli_main(["ckpt", "verify", str(newest)]) == 2
    out = capsys.readouterr().out
    assert "UNREADABLE" in out and str(blocked) in out and "CORRUPT" not in out


# ---------------------------------------------------------------- the two-tier local tier


def test_a_failed_two_tier_save_prunes_the_local_tier_and_names_it(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    parts = make_parts(step=1)
    writer = CheckpointWriter(tmp_path / "checkpoints", ClusterEnv(), local_dir=str(tmp_path / "local"))
    writer.save(snapshot(parts.state(), ClusterEnv(), {}, {}), blocking=True)
    local = writer.local
    assert local is not None and sorted(p.name for p in local.iterdir()) == ["step-000000001"]

    def full(path: Path, tensors: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(tensorfile, "write", full)
    parts.counters.step = 2
    with pytest.raises(layout.CheckpointError) as info:
        writer.save(snapshot(parts.state(), ClusterEnv(), {}, {}), blocking=True)
    assert f"permissions of {local} (checkpoint.local_dir" in str(info.value)
    assert sorted(p.name for p in local.iterdir()) == ["step-000000001"]  # the failed partial is gone
    assert _steps(tmp_path) == [1]
    writer.close()


def test_restart_reads_the_verified_node_local_copy_else_the_shared_one(tmp_path: Path,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    ref = _train(tmp_path / "ref")
    local = f"checkpoint.local_dir={tmp_path / 'local'}"
    for name, tamper in (("as-is", False), ("tampered", True)):
        run = tmp_path / name
        _train(run, local, "checkpoint.every_steps=2", "train.max_steps=4")  # then resumed to the end of the epoch
        (run / "summary.json").unlink()
        tier = _local_root(str(tmp_path / "local"), run / "checkpoints")
        copy = tier / "step-000000004"
        assert [p.name for p in tier.iterdir()] == [copy.name]  # the newest only
        if tamper:
            data = bytearray((copy / REPLICATED_TENSORS).read_bytes())
            data[-1] ^= 0x01
            (copy / REPLICATED_TENSORS).write_bytes(bytes(data))
        caplog.clear()
        with caplog.at_level(logging.INFO, "hpctrain"):
            summary = _train(run, local, "checkpoint.every_steps=2")
        assert summary["params_sha256"] == ref["params_sha256"]  # bit-identical either way
        from_local = f"read replicated.pt, {REPLICATED_TENSORS}, rank-00000.pt from the node-local copy {copy}"
        if tamper:
            assert f"the node-local copy {copy / REPLICATED_TENSORS} does not match" in caplog.text
            assert f"read replicated.pt, rank-00000.pt from the node-local copy {copy}" in caplog.text
        else:
            assert from_local in caplog.text and "does not match" not in caplog.text


# ---------------------------------------------------------------- process groups


def test_the_checkpoint_groups_use_the_job_timeout(tmp_path: Path) -> None:
    """Not torch's 30-minute default: a rank that died mid-save fails the others as soon as the
    training group would (parallel.init_timeout_s)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=77))
    try:
        group = default_group(SimpleNamespace(distributed=True))  # type: ignore[arg-type]
        assert group._get_backend(CPU).options._timeout == datetime.timedelta(seconds=77)
    finally:
        dist.destroy_process_group()
