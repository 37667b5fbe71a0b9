"""One live run per run directory (issue 17, point 2): a second run refuses with exit 2 naming
the owner; a lock whose owner died (SIGKILL) is taken over with a log line; a run that ends
leaves no lock behind. fcntl locks belong to a process, so the owner here is a real one."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hpctrain.cli import main as cli_main
from hpctrain.core.run_lock import LOCK_NAME, RunDirLock
from tests.dist_utils import ROOT, launch_env

BASE = ["train", "model.name=tests.ckpt_models:tiny_mlp", "data.name=synthetic_tiny", "data.synthetic_size=64",
        "data.batch_size=16", "data.max_val_samples=16", "train.epochs=1", "train.progress=false",
        "checkpoint.every_seconds=None", "train.threads=1", "resume=auto"]
HOLD = ("import sys, time; from pathlib import Path; from hpctrain.core.run_lock import RunDirLock; "
        "RunDirLock(Path(sys.argv[1])).acquire(); print('held', flush=True); time.sleep(120)")


def _holder(run_dir: Path) -> subprocess.Popen[str]:
    run_dir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], cwd=ROOT, env=launch_env(),
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_run_refuses_naming_the_owner_then_takes_over_a_dead_owners_lock(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    run_dir = tmp_path / "run"
    owner = _holder(run_dir)
    try:
        assert cli_main([*BASE, f"run.dir={run_dir}"]) == 2
        err = capsys.readouterr().err
        assert f"run.dir {run_dir} is in use by another run" in err and f"pid {owner.pid}" in err, err
        assert "Traceback" not in err and not (run_dir / "summary.json").exists()
    finally:
        owner.send_signal(signal.SIGKILL)  # dies holding it: the kernel drops the lock, the file stays
        owner.wait()
    assert (run_dir / LOCK_NAME).exists()
    with caplog.at_level(logging.WARNING):
        assert cli_main([*BASE, f"run.dir={run_dir}"]) == 0
    assert "taking over the lock of a run that ended without releasing it" in caplog.text
    assert f"pid {owner.pid}" in caplog.text
    assert (run_dir / "summary.json").exists() and not (run_dir / LOCK_NAME).exists()  # released at the end


def test_the_lock_is_released_and_reusable(tmp_path: Path) -> None:
    lock = RunDirLock(tmp_path)
    lock.acquire()
    # parsed, not counted in the text: the pid's digits may recur in "since"
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()
    lock.release()  # twice is harmless
    assert not (tmp_path / LOCK_NAME).exists()
    again = RunDirLock(tmp_path)
    again.acquire()
    again.release()
