"""Checkpoint layout, commit protocol, corruption, failing writes, async == sync bytes,
retention, schedules, resume rules, CLI. Single process, tiny model, in-process runs."""

from __future__ import annotations

import errno
import json
import logging
import time
from pathlib import Path

import pytest
import torch

from hpctrain.checkpoint import layout, policy, tensorfile
from hpctrain.checkpoint.checkpointer import Checkpointer
from hpctrain.checkpoint.state import REPLICATED, REPLICATED_TENSORS, rank_file, snapshot
from hpctrain.checkpoint.writer import CheckpointWriter
from hpctrain.cli import main as cli_main
from hpctrain.config import ConfigError, load_config
from hpctrain.core.env import ClusterEnv
from hpctrain.core.rundir import RunDirError
from hpctrain.train import train
from tests.ckpt_models import Parts, make_parts

BASE = ["model.name=tests.ckpt_models:tiny_mlp", "data.name=synthetic_tiny", "data.synthetic_size=256",
        "data.batch_size=16", "data.max_val_samples=32", "train.epochs=2", "train.log_every=1",
        "train.progress=false", "checkpoint.every_seconds=None", "train.threads=1"]


def _train(run_dir: Path, *extra: str) -> dict:
    return train(load_config(None, [*BASE, f"run.dir={run_dir}", *extra]))


def _steps(run_dir: Path) -> list[int]:
    return [s for s, _ in layout.committed(run_dir / "checkpoints")]


# ---------------------------------------------------------------- layout and commit


def test_layout_manifest_and_no_leftovers(tmp_path: Path) -> None:
    run = tmp_path / "run"
    summary = _train(run, "checkpoint.every_steps=5", "checkpoint.keep_last=2", "checkpoint.keep_every=10")
    root = run / "checkpoints"
    assert _steps(run) == [10, 20, 30, 32]  # keep_every=10 keeps 10 and 20 besides the newest two
    assert not list(root.glob(".partial-*"))
    manifest = layout.read_manifest(root / "step-000000032")
    assert manifest["step"] == 32 and manifest["epoch"] == 2 and manifest["world_size"] == 1
    assert set(manifest["files"]) == {REPLICATED, REPLICATED_TENSORS, rank_file(0)}
    assert {"torch", "hpctrain", "python"} <= set(manifest["versions"])
    assert isinstance(manifest["save_s"], float) and manifest["save_s"] >= 0  # sizes hpctrain slurm's USR1 lead
    assert all(layout.verify(p) == [] for _, p in layout.committed(root))
    assert summary["outcome"] == "finished"
    assert json.loads((run / "status.json").read_text())["outcome"] == "finished"
    from safetensors.torch import load_file  # the tensor bytes are plain safetensors

    assert "/model/0.weight" in load_file(root / "step-000000032" / REPLICATED_TENSORS)
    state = torch.load(root / "step-000000032" / rank_file(0), weights_only=True)
    assert {"rng", "loader", "counters"} <= set(state) and {"python", "numpy", "torch"} <= set(state["rng"])


def test_retention_rules() -> None:
    steps = [5, 10, 15, 20, 25]
    assert layout.to_delete(steps, keep_last=2, keep_every=None, protect=set()) == [5, 10, 15]
    assert layout.to_delete(steps, keep_last=1, keep_every=10, protect={5}) == [15]
    assert layout.to_delete(steps, keep_last=0, keep_every=None, protect=set())[-1] != 25  # newest survives


def test_failed_deletion_is_logged_not_fatal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              caplog: pytest.LogCaptureFixture) -> None:
    def refuse(path: Path) -> None:
        raise OSError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(layout.shutil, "rmtree", refuse)
    with caplog.at_level(logging.WARNING, "hpctrain"):
        _train(tmp_path / "run", "checkpoint.every_steps=4", "checkpoint.keep_last=1", "train.epochs=1")
    assert "could not delete" in caplog.text
    assert _steps(tmp_path / "run")[-1] == 16


# ---------------------------------------------------------------- corruption


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_corrupt_newest_is_skipped_by_name(tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture) -> None:
    run = tmp_path / "run"
    _train(run, "checkpoint.every_steps=8", "train.max_steps=24", "checkpoint.at_end=false")
    # the skeleton truncated, a byte of the tensor bytes flipped
    newest = run / "checkpoints" / "step-000000024" / (REPLICATED if damage == "truncate" else REPLICATED_TENSORS)
    data = bytearray(newest.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2] ^= 0x01
    newest.write_bytes(bytes(data))
    assert cli_main(["ckpt", "verify", str(run)]) == 1
    with caplog.at_level(logging.WARNING, "hpctrain"):
        found = layout.newest_valid(run / "checkpoints")
    assert found is not None and found.step == 16
    assert "step-000000024" in caplog.text and "skipped" in caplog.text
    # resume=auto continues from step 16 once the run looks unfinished (as if killed at step 24)
    (run / "summary.json").unlink()
    caplog.clear()
    with caplog.at_level(logging.INFO, "hpctrain"):
        summary = _train(run, "checkpoint.every_steps=8", "train.max_steps=24", "checkpoint.at_end=false")
    assert "resumed from" in caplog.text and "step-000000016" in caplog.text
    assert summary["steps"] == 24


# ---------------------------------------------------------------- failing writes


def _parts(seed: int = 0) -> Parts:
    return make_parts(seed, step=1)


def _snap(parts: Parts):  # type: ignore[no-untyped-def]
    return snapshot(parts.state(), ClusterEnv(), {"seed": 0}, {})


@pytest.mark.parametrize("failure, where", [(errno.ENOSPC, "tensor bytes"), (errno.EROFS, "small files")])
def test_failing_write_keeps_previous_and_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    failure: int, where: str) -> None:
    parts = _parts()
    writer = CheckpointWriter(tmp_path / "checkpoints", ClusterEnv())
    writer.save(_snap(parts))
    good = writer.wait()
    assert good is not None and layout.verify(good) == []

    def fail(*args: object) -> None:
        raise OSError(failure, "simulated", "the target")

    if where == "tensor bytes":  # a full disk part-way through the big file
        real_write_all = tensorfile._write_all
        calls = iter(range(100))

        def write_all(fd: int, data: memoryview) -> None:
            real_write_all(fd, data) if next(calls) == 0 else fail()

        monkeypatch.setattr(tensorfile, "_write_all", write_all)
        monkeypatch.setattr(tensorfile, "CHUNK", 4096)  # several chunks even for a tiny model
    else:  # a file system that turned read-only
        monkeypatch.setattr(layout.HashingWriter, "write", lambda self, data: fail())
    parts.counters.step = 2
    with pytest.raises(layout.CheckpointError) as info:
        writer.save(_snap(parts))
    message = str(info.value)
    assert "step-000000002" in message and "intact" in message and "step-000000001" in message
    assert "simulated" in message
    assert layout.verify(good) == [] and _steps(tmp_path) == [1]
    assert not list((tmp_path / "checkpoints").glob(".partial-*"))
    writer.close()


def test_async_error_surfaces_at_next_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    parts = _parts()
    writer = CheckpointWriter(tmp_path / "checkpoints", ClusterEnv(), mode="async")
    monkeypatch.setattr(layout, "commit", lambda *a, **k: (_ for _ in ()).throw(OSError(errno.EIO, "disk gone")))
    writer.save(_snap(parts))  # returns at once; the error waits for the next save
    parts.counters.step = 2
    with pytest.raises(layout.CheckpointError, match="disk gone"):
        writer.save(_snap(parts))
    writer.close()


# ---------------------------------------------------------------- async == sync


def test_async_saves_produce_the_same_bytes_as_sync(tmp_path: Path) -> None:
    parts = _parts()
    sync = CheckpointWriter(tmp_path / "sync", ClusterEnv(), mode="sync")
    early = CheckpointWriter(tmp_path / "async", ClusterEnv(), mode="async")
    for step in (1, 2):  # the second async save reuses its staging buffers
        parts.counters.step = step
        sync.save(_snap(parts))
        early.save(_snap(parts))
        with torch.no_grad():  # training goes on while the async write is in flight
            for p in parts.model.parameters():
                p.add_(1.0)
        early.wait()
    for step in (1, 2):
        a = layout.read_manifest(tmp_path / "sync" / layout.step_name(step))["files"]
        b = layout.read_manifest(tmp_path / "async" / layout.step_name(step))["files"]
        assert a == b  # same names, sizes and sha256
    sync.close()
    early.close()


def test_async_copies_parameters_before_the_next_optimizer_step(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from hpctrain.checkpoint import writer as writer_module

    real_copy = writer_module.Stager._copy

    def slow_copy(self: writer_module.Stager, tensor: torch.Tensor, path: tuple) -> torch.Tensor:
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.02)  # a slow writer thread: only the step pre-hook keeps the copy consistent
        return real_copy(self, tensor, path)

    monkeypatch.setattr(writer_module.Stager, "_copy", slow_copy)
    for mode in ("sync", "async"):
        parts = _parts()
        cfg = load_config(None, ["checkpoint.every_seconds=None", f"checkpoint.mode={mode}"])
        ckpt = Checkpointer(tmp_path / mode, ClusterEnv(), torch.device("cpu"), cfg.checkpoint, parts.state())
        parts.counters.step = 2
        ckpt.save({})
        parts.model(torch.randn(4, 8)).sum().backward()
        parts.optimizer.step()  # changes parameters and optimizer state
        ckpt.close()
    files = [layout.read_manifest(tmp_path / m / "checkpoints" / "step-000000002")["files"] for m in ("sync", "async")]
    assert files[0][REPLICATED_TENSORS] == files[1][REPLICATED_TENSORS]


def test_async_and_two_tier_training_match_sync(tmp_path: Path) -> None:
    ref = _train(tmp_path / "sync", "checkpoint.every_steps=3")
    fast = _train(tmp_path / "async", "checkpoint.every_steps=3", "checkpoint.mode=async",
                  f"checkpoint.local_dir={tmp_path / 'local'}")
    assert fast["params_sha256"] == ref["params_sha256"]
    assert _steps(tmp_path / "async") == _steps(tmp_path / "sync")
    for step in _steps(tmp_path / "sync"):
        a = layout.read_manifest(tmp_path / "sync" / "checkpoints" / layout.step_name(step))["files"]
        b = layout.read_manifest(tmp_path / "async" / "checkpoints" / layout.step_name(step))["files"]
        assert a[rank_file(0)] == b[rank_file(0)]  # replicated.pt differs only by the config inside
    assert all(layout.verify(p) == [] for _, p in layout.committed(tmp_path / "async" / "checkpoints"))


# ---------------------------------------------------------------- resume rules and formats


def test_resume_continues_unfinished_and_refuses_finished(tmp_path: Path) -> None:
    run = tmp_path / "run"
    ref = _train(tmp_path / "ref", "optim.schedule=constant")  # max_steps must not change the LR curve
    _train(run, "train.max_steps=10", "optim.schedule=constant")  # then extended to 2 epochs
    (run / "summary.json").unlink()
    resumed = _train(run, "optim.schedule=constant")
    assert resumed["params_sha256"] == ref["params_sha256"]
    with pytest.raises(RunDirError, match="finished run .*nothing to resume"):
        _train(run, "optim.schedule=constant")
    with pytest.raises(RunDirError, match="resume=auto continues it"):
        (run / "summary.json").unlink()
        _train(run, "resume=never")


def test_resume_from_explicit_path_and_dcp_format_export(tmp_path: Path) -> None:
    run = tmp_path / "run"
    ref = _train(run, "checkpoint.format=dcp", "checkpoint.every_steps=10")
    ckpt = run / "checkpoints" / "step-000000020"
    assert any(name.startswith("sharded/") for name in layout.read_manifest(ckpt)["files"])
    other = _train(tmp_path / "other", f"resume={ckpt}", "checkpoint.format=dcp")
    assert other["params_sha256"] == ref["params_sha256"]
    for out in ("w.safetensors", "w.pt"):
        assert cli_main(["ckpt", "export", str(run), str(tmp_path / out)]) == 0
    from safetensors.torch import load_file

    exported = load_file(tmp_path / "w.safetensors")
    final = torch.load(run / "model.pt", weights_only=True)
    assert exported.keys() == final.keys() and all(torch.equal(exported[k], final[k]) for k in final)


def test_cli_list_and_verify(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    _train(run, "checkpoint.every_steps=16")
    assert cli_main(["ckpt", "list", str(run), "--verify"]) == 0
    out = capsys.readouterr().out
    assert "step-000000016" in out and "step-000000032" in out and "ok" in out
    assert cli_main(["ckpt", "verify", str(run / "checkpoints" / "step-000000016")]) == 0


# ---------------------------------------------------------------- policy and config


def test_young_daly_and_schedules() -> None:
    assert policy.young_daly_seconds(10.0, 2.0) == pytest.approx((2 * 10.0 * 7200) ** 0.5)
    now = [0.0]
    sched = policy.Schedule(5, "60", 2.0, clock=lambda: now[0])
    assert sched.step_due(10) and not sched.step_due(11) and not sched.time_due()
    now[0] = 61.0
    assert sched.time_due()
    sched.saved(0.5, 1.0)
    assert not sched.time_due()
    auto = policy.Schedule(None, "auto", 2.0, state_bytes=0, clock=lambda: now[0])
    auto.saved(2.0, 3.0)
    assert auto.interval == pytest.approx((2 * 2.0 * 7200) ** 0.5)


@pytest.mark.parametrize("override, hint", [
    ("checkpoint.keep_last=0", "newest good checkpoint"), ("checkpoint.every_seconds=soon", "Young-Daly"),
    ("checkpoint.signals=[SIGKILL]", "SIGUSR1"),
])
def test_config_errors_name_the_key(override: str, hint: str) -> None:
    with pytest.raises(ConfigError, match=hint):
        load_config(None, [override])


def test_checkpointer_in_a_hand_written_loop(tmp_path: Path) -> None:
    parts = _parts()
    cfg = load_config(None, ["checkpoint.every_steps=2", "checkpoint.every_seconds=None"])
    ckpt = Checkpointer(tmp_path, ClusterEnv(), torch.device("cpu"), cfg.checkpoint, parts.state())
    for step in range(2, 5):
        parts.counters.step = step
        assert ckpt.at_step({}) is False
    ckpt.finish({})
    ckpt.close()
    assert _steps(tmp_path) == [2, 4]
