"""``hpctrain run`` under a preemption signal sent to its whole process group (issue 9, section 0).

What Slurm's ``--signal=USR1@T`` (without ``B:``) and ``scancel --signal=USR1`` do to a job
step: every process of the task's group gets USR1. The ranks live in their own sessions
(torch starts them so), so only the launcher sees it; it must forward it, wait for the
agreed save and exit 3, leaving no process behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpctrain.checkpoint import layout
from hpctrain.errors import EXIT_PREEMPTED
from hpctrain.launch.local import signals_to_handle, torchrun_accepts, torchrun_args
from tests.ckpt_models import SLOW_RUN_ARGS
from tests.dist_utils import finish_launch, launch_env

ROOT = Path(__file__).resolve().parents[2]
ARGS = SLOW_RUN_ARGS
TIMEOUT = 120
_env = launch_env


def _start(run_dir: Path, *extra: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "hpctrain", "run", "-n", "2", "train", *ARGS, f"run.dir={run_dir}", *extra]
    return subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _finish(proc: subprocess.Popen[bytes]) -> tuple[int, str]:
    return finish_launch(proc, TIMEOUT)


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait_for_checkpoint(run_dir: Path, proc: subprocess.Popen[bytes]) -> int:
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        saved = layout.committed(run_dir / "checkpoints")
        if saved:
            return saved[0][0]
        if proc.poll() is not None:
            pytest.fail(f"run ended before its first checkpoint:\n{proc.communicate()[0].decode()[-4000:]}")
        time.sleep(0.05)
    pytest.fail(f"no committed checkpoint within {TIMEOUT} s")


def test_torchrun_args_ask_torch_to_forward_the_preemption_signals() -> None:
    args = torchrun_args(2, ["train"], signals=["SIGUSR1", "SIGTERM"], shutdown_timeout=120, node_rank=1)
    assert "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1" in args
    assert "--node-rank=1" in args
    assert ("--shutdown-timeout=120" in args) == torchrun_accepts("--shutdown-timeout")  # torch 2.11 lacks it
    assert signals_to_handle(["SIGUSR2", "SIGTERM", "SIGUSR2"]) == ["SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR2"]


def test_usr1_to_the_process_group_saves_exits_3_leaves_nothing_and_resumes_bit_identical(tmp_path: Path) -> None:
    reference = tmp_path / "reference"
    code, out = _finish(_start(reference, "checkpoint.enabled=false"))
    assert code == 0, out[-4000:]

    run_dir = tmp_path / "run"
    proc = _start(run_dir, "checkpoint.every_steps=8")
    first = _wait_for_checkpoint(run_dir, proc)
    ranks = _children(proc.pid)
    assert len(ranks) == 2, ranks
    assert all(os.getpgid(r) != proc.pid for r in ranks)  # torch gives each rank its own session
    os.killpg(proc.pid, signal.SIGUSR1)  # what `scancel --signal=USR1` does to a job step's task
    code, out = _finish(proc)
    assert code == EXIT_PREEMPTED, out[-4000:]
    assert json.loads((run_dir / "status.json").read_text())["outcome"] == "preempted"
    saved = [s for s, _ in layout.committed(run_dir / "checkpoints")]
    assert saved[-1] > first and saved[-1] < 64, (first, saved)  # the preemption save, mid-epoch
    deadline = time.monotonic() + 10
    while (any(_alive(r) for r in ranks) or _group_alive(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(r) for r in ranks), "a rank outlived the launcher"
    assert not _group_alive(proc.pid), "a process of the launcher's group is still there"

    code, out = _finish(_start(run_dir, "checkpoint.every_steps=8"))
    assert code == 0, out[-4000:]
    got, want = (json.loads((d / "summary.json").read_text()) for d in (run_dir, reference))
    assert got["steps"] == want["steps"] == 64
    assert got["params_sha256"] == want["params_sha256"]


def test_options_this_torch_lacks_are_left_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cluster's torch may predate --shutdown-timeout (2.11 has none): leave it out, never fail."""
    from hpctrain.launch import local

    monkeypatch.setattr(local, "torchrun_accepts", lambda option: option != "--shutdown-timeout")
    args = torchrun_args(2, ["train"], signals=["SIGUSR1"])
    assert not any(a.startswith("--shutdown-timeout") for a in args)
    assert any(a.startswith("--signals-to-handle=") for a in args)
    assert local.get_args_parser().parse_args(args)  # what is left parses


def test_this_torchs_parser_is_asked_not_its_version() -> None:
    from hpctrain.launch.local import torchrun_accepts

    assert torchrun_accepts("--nproc-per-node")
    assert not torchrun_accepts("--no-such-option-anywhere")


def test_the_first_rank_to_fail_gives_the_exit_code_not_a_rank_killed_after_it() -> None:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from hpctrain.launch.local import rank_exit_code

    def failure(rank: int, code: int, when: float) -> ProcessFailure:
        found = ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=code, error_file="")
        found.timestamp = int(when)
        return found

    killed_later = {0: failure(0, -15, 20), 1: failure(1, 2, 10)}
    assert rank_exit_code(ChildFailedError("hpctrain", killed_later)) == 2
    assert rank_exit_code(ChildFailedError("hpctrain", {0: failure(0, -9, 5)})) == 1
