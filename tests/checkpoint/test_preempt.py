"""Kill and signal real 2-rank runs (`hpctrain run`, torchrun's agent, gloo) and resume them: final
weights must be bit-identical.

Each run is a subprocess; steps are slowed to ~20 ms (tests.ckpt_models:slow_mlp) so a
signal lands mid-epoch. Epochs have 32 steps; runs are 2 epochs.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpctrain.checkpoint import layout
from hpctrain.cli import main as cli_main
from hpctrain.core.errors import EXIT_PREEMPTED
from hpctrain.core.protocol import read_status
from tests.ckpt_models import SLOW_RUN_ARGS
from tests.dist_utils import finish_launch, launch_env, train_cases

pytestmark = pytest.mark.slow  # launches or several ranks: scheduled first (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]
ARGS = SLOW_RUN_ARGS
TIMEOUT = 120
_env = launch_env


def _hpctrain_run(run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "hpctrain", "run", "-n", "2", "train", *ARGS, f"run.dir={run_dir}", *extra]


def _start(cmd: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _finish(proc: subprocess.Popen[bytes]) -> tuple[int, str]:
    return finish_launch(proc, TIMEOUT)


def _run(cmd: list[str]) -> tuple[int, str]:
    return _finish(_start(cmd))


def _last_step(run_dir: Path) -> int:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return 0
    steps = [json.loads(line).get("step", 0) for line in lines if line.endswith("}")]
    return max(steps, default=0)


def _wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen[bytes]) -> int:
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        current = _last_step(run_dir)
        if current >= step:
            return current
        if proc.poll() is not None:
            pytest.fail(f"run ended before step {step}:\n{proc.communicate()[0].decode()[-4000:]}")
        time.sleep(0.01)
    pytest.fail(f"no step {step} within {TIMEOUT} s")


def _params(run_dir: Path) -> str:
    return json.loads((run_dir / "summary.json").read_text())["params_sha256"]


def _workers(launcher_pid: int) -> list[int]:
    """The rank processes: children of the torchrun agent (which is the launcher itself)."""
    out = subprocess.run(["pgrep", "-P", str(launcher_pid)], capture_output=True, text=True).stdout
    return [int(pid) for pid in out.split()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The uninterrupted run, on forked ranks (the launchers are what the tests below try)."""
    root = tmp_path_factory.mktemp("ref")
    got = train_cases(2, [("run", [*ARGS, "checkpoint.enabled=false"])], root, keep=("params_sha256",))[0]["run"]
    assert isinstance(got, dict), got
    return _params(root / "run")


def test_sigusr1_to_one_rank_saves_within_a_step_and_resumes_bit_identical(tmp_path: Path, reference: str) -> None:
    run_dir = tmp_path / "run"
    dcp = "checkpoint.format=dcp"  # sharded writer: every rank writes through torch.distributed.checkpoint
    proc = _start(_hpctrain_run(run_dir, dcp))  # no step schedule: only the signal saves
    seen = _wait_for_step(run_dir, 20, proc)
    ranks = _workers(proc.pid)
    assert len(ranks) == 2, ranks
    os.kill(ranks[-1], signal.SIGUSR1)  # one rank only: the all-reduce must carry it to the other
    signalled = _last_step(run_dir)  # the step logged when the signal had arrived, or later on a busy machine
    code, out = _finish(proc)
    assert code == EXIT_PREEMPTED, out[-4000:]
    status = json.loads((run_dir / "status.json").read_text())
    assert status["outcome"] == "preempted"
    saved = [s for s, _ in layout.committed(run_dir / "checkpoints")]
    assert len(saved) == 1 and seen <= saved[0] <= signalled + 2, (seen, signalled, saved)  # within a step
    assert not (run_dir / "summary.json").exists()
    code, out = _run(_hpctrain_run(run_dir, dcp))
    assert code == 0, out[-4000:]
    assert json.loads((run_dir / "status.json").read_text())["outcome"] == "finished"
    assert _params(run_dir) == reference
    # the 2-rank sharded checkpoint consolidates in one process, without a process group
    import torch
    from safetensors.torch import load_file

    assert cli_main(["ckpt", "export", str(run_dir), str(tmp_path / "w.safetensors")]) == 0
    exported, final = load_file(tmp_path / "w.safetensors"), torch.load(run_dir / "model.pt", weights_only=True)
    assert exported.keys() == final.keys() and all(torch.equal(exported[k], final[k]) for k in final)
    # ... and resumes at world size 1: DCP reshards model and optimizer, the loader gets rank 0's position
    from hpctrain.config import load_config
    from hpctrain.train import train

    preempted = run_dir / "checkpoints" / layout.step_name(saved[0])
    summary = train(load_config(None, [*ARGS, dcp, f"resume={preempted}",
                                       f"train.max_steps={saved[0] + 3}", f"run.dir={tmp_path / 'one-rank'}"]))
    assert summary["steps"] == saved[0] + 3 and summary["world_size"] == 1


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_usr1_to_the_process_group_saves_exits_3_leaves_nothing_and_resumes_bit_identical(tmp_path: Path,
                                                                                         reference: str) -> None:
    """What Slurm's ``--signal=USR1@T`` (without ``B:``) and ``scancel --signal=USR1`` do to a job step:
    every process of the task's group gets USR1. The ranks live in sessions of their own (torch starts
    them so), so only the launcher sees it; it forwards it, waits for the agreed (here async) save and
    exits 3, leaving no process behind. (SIGTERM to the launcher alone, what a batch script's trap
    sends, takes the same forwarding: tests/slurm/test_requeue.py, tests/train/test_deepspeed.py.)"""
    run_dir = tmp_path / "run"
    cmd = _hpctrain_run(run_dir, "checkpoint.mode=async")  # no step schedule: only the signal saves
    proc = _start(cmd)
    seen = _wait_for_step(run_dir, 20, proc)
    ranks = _workers(proc.pid)
    assert len(ranks) == 2 and all(os.getpgid(r) != proc.pid for r in ranks), ranks
    os.killpg(proc.pid, signal.SIGUSR1)
    signalled = _last_step(run_dir)
    code, out = _finish(proc)
    assert code == EXIT_PREEMPTED, out[-4000:]
    assert read_status(run_dir)["outcome"] == "preempted"
    saved = [s for s, _ in layout.committed(run_dir / "checkpoints")]
    assert len(saved) == 1 and seen <= saved[0] <= signalled + 2, (seen, signalled, saved)  # within a step
    deadline = time.monotonic() + 10
    while (any(_alive(r) for r in ranks) or _group_alive(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(r) for r in ranks), "a rank outlived the launcher"
    assert not _group_alive(proc.pid), "a process of the launcher's group is still there"
    code, out = _run(cmd)
    assert code == 0, out[-4000:]
    assert _params(run_dir) == reference


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper counts as ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"


def test_sigkill_of_the_launcher_mid_epoch_ends_its_ranks_and_the_restart_is_bit_identical(tmp_path: Path,
                                                                                         reference: str) -> None:
    """SIGKILL of `hpctrain run`'s process group mid-epoch (a node failure, the OOM killer, `timeout -s
    KILL`): nothing gets to clean up. It reaches no rank directly (each is in a session of its own);
    the kernel ends them (PR_SET_PDEATHSIG), so no orphan trains on into the directory the restart
    uses, and the restart resumes from the last committed checkpoint, bit for bit."""
    run_dir = tmp_path / "run"
    kill_at = random.Random().randint(6, 28) + 32 * random.Random().randint(0, 1)  # mid-epoch, either epoch
    cmd = _hpctrain_run(run_dir, "checkpoint.every_steps=4")
    proc = _start(cmd)
    _wait_for_step(run_dir, kill_at, proc)
    ranks = _workers(proc.pid)
    assert len(ranks) == 2, ranks
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    deadline = time.monotonic() + 5
    while any(_alive(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in ranks), "ranks outlived their launcher"
    assert not (run_dir / "summary.json").exists()
    saved = [s for s, _ in layout.committed(run_dir / "checkpoints")]
    assert saved and saved[-1] < 64, saved
    code, out = _run(cmd)  # the restart, as the README says: resumes from the last committed checkpoint
    assert code == 0, out[-4000:]
    assert f"resumed from {run_dir / 'checkpoints' / layout.step_name(saved[-1])}" in out
    assert _params(run_dir) == reference, f"killed at step ~{kill_at}, resumed from {saved[-1]}"


def _rank_importing_torch(launcher: subprocess.Popen[bytes]) -> int:
    """A rank of ``launcher`` that is importing torch: started (its own command line, not the
    launcher's from before exec) and with libtorch mapped. The trainer's own handler comes
    seconds later, after the import, the set-up and the rendezvous."""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline and launcher.poll() is None:
        for pid in _workers(launcher.pid):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                if b"run" not in argv and b"libtorch" in Path(f"/proc/{pid}/maps").read_bytes():
                    return pid
            except OSError:  # ended, or not ours to read yet
                continue
        time.sleep(0.005)
    pytest.fail(f"no rank importing torch within {TIMEOUT} s:\n{launcher.communicate()[0].decode()[-4000:]}")


def _wait_for_outcome(run_dir: Path, outcome: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + TIMEOUT
    while read_status(run_dir).get("outcome") != outcome:
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"no {outcome!r} in status.json:\n{proc.communicate()[0].decode()[-4000:]}")
        time.sleep(0.01)


def test_signals_in_start_up_and_after_the_save_end_in_exit_3_and_resume_bit_identical(tmp_path: Path,
                                                                                      reference: str) -> None:
    """Issue 17, point 6. USR1 to a rank still importing torch (no trainer handler yet) used to end
    it by the signal: now `hpctrain train` keeps it from its first line, and every rank saves after
    step 1 and exits 3. Then the launcher gets USR1 twice, a few hundred ms apart, as the ranks end
    (a repeated Slurm warning, or the warning plus an admin's), and once more while it exits: it used
    to die by the signal (138) once it had put back the default action (or Python had, at exit)."""
    run_dir = tmp_path / "run"
    proc = _start(_hpctrain_run(run_dir))
    os.kill(_rank_importing_torch(proc), signal.SIGUSR1)
    _wait_for_outcome(run_dir, "preempted", proc)  # committed; the ranks are on their way out
    for _ in range(2):
        os.kill(proc.pid, signal.SIGUSR1)
        time.sleep(0.3)
    ranks = _workers(proc.pid)
    deadline = time.monotonic() + TIMEOUT
    while any(_alive(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)  # the launcher has left torch's agent and is exiting (its last second or two)
    os.kill(proc.pid, signal.SIGUSR1)
    code, out = _finish(proc)
    assert code == EXIT_PREEMPTED, out[-4000:]
    assert "SIGUSR1 arrived during start-up: saving after the first step" in out
    assert [s for s, _ in layout.committed(run_dir / "checkpoints")] == [1]
    code, out = _run(_hpctrain_run(run_dir))
    assert code == 0, out[-4000:]
    assert _params(run_dir) == reference
