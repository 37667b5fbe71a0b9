"""Hang detection (hpctrain run --hang-timeout): the heartbeat, the laggard, the report, the end.

The unit tests drive the watchdog over hand-written heartbeats of real (sleeping, stopped)
processes; the end-to-end tests stall a real 2- or 3-rank job three ways: a deadlock in the
user's model (then a restart in place), SIGSTOP of one rank, and SIGSTOP of one rank's data
worker. Each must end within hang-timeout + 30 s, name the right rank and keep every
committed checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpctrain.checkpoint import layout
from hpctrain.core import protocol
from hpctrain.core.errors import EXIT_HUNG
from hpctrain.launch import watchdog
from hpctrain.telemetry import meter
from tests.checkpoint import test_preempt as preempt
from tests.dist_utils import finish_launch, launch_env

pytestmark = pytest.mark.slow  # launches or several ranks: scheduled first (tests/conftest.py)

HANG_S = 3
TINY = ["model.name=tests.user_models:tiny_mlp", "data.name=synthetic_tiny", "data.synthetic_size=1024",
        "data.batch_size=16", "data.max_val_samples=32", "train.epochs=1", "train.log_every=1",
        "train.progress=false", "train.threads=1", "checkpoint.every_steps=2"]


# ---------------------------------------------------------------- the parts, in-process


def test_phase_names_follow_the_meter() -> None:
    """The heartbeat stores the meter's phase numbers; its words must match them."""
    assert protocol.DOING_AFTER[meter.DATA].startswith("forward")
    assert protocol.DOING_AFTER[meter.OPTIM].startswith("the after-step")
    assert protocol.DOING_AFTER[meter.CKPT] == "loading the next batch"
    assert protocol.LONG_PHASES == {protocol.VALIDATING, protocol.SAVING, protocol.RESUMING, protocol.FINISHING}


def test_a_heartbeat_counts_laps_and_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(protocol, "_current", None)
    beat = protocol.from_env({protocol.HEARTBEAT_ENV: str(tmp_path), "RANK": "3", "TORCHELASTIC_RESTART_COUNT": "2"})
    assert beat is not None
    first = protocol.read_beat(protocol.beat_path(tmp_path, 3))
    assert first is not None and (first.rank, first.restart, first.pid, first.phase) == (3, 2, os.getpid(), -1)
    beat.at_step(40)
    for phase in (meter.DATA, meter.FORWARD, meter.BACKWARD, meter.OPTIM, meter.OTHER, meter.CKPT):
        beat.beat(phase)
    now = protocol.read_beat(protocol.beat_path(tmp_path, 3))
    assert now is not None and (now.laps, now.step, now.done, now.phase) == (6, 41, 1, meter.CKPT)
    assert now.time >= first.time
    monkeypatch.setattr(protocol, "_current", None)


@pytest.fixture
def sleepers() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs = [subprocess.Popen(["sleep", "120"]) for _ in range(3)]
    yield procs
    for p in procs:
        p.kill()
        p.wait()


def _write_beat(directory: Path, rank: int, pid: int, laps: int, phase: int, age: float, done: int = 5) -> None:
    data = protocol._FORMAT.pack(protocol._MAGIC, rank, 0, pid, phase, laps, 10, done, time.monotonic() - age)
    protocol.beat_path(directory, rank).write_bytes(data.ljust(protocol._SIZE, b"\0"))


def _wait_stopped(pid: int) -> None:
    deadline = time.monotonic() + 10
    while not watchdog.process_state(pid).startswith("stopped"):
        assert time.monotonic() < deadline, f"pid {pid} did not stop"
        time.sleep(0.01)


def test_the_laggard_is_named_and_every_rank_ended(tmp_path: Path, sleepers: list[subprocess.Popen[bytes]],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Three ranks all silent for 10 s: rank 1 has one lap fewer (the others wait for it in a
    collective). Rank 2 is stopped but not behind: laps decide, not the process state."""
    beats, run_dir = tmp_path / "beats", tmp_path / "run"
    beats.mkdir()
    monkeypatch.setattr(watchdog, "python_stacks", lambda _dir, rank: f"stacks of rank {rank.rank}")
    os.kill(sleepers[2].pid, signal.SIGSTOP)
    _wait_stopped(sleepers[2].pid)
    for rank, laps in enumerate((21, 20, 21)):
        _write_beat(beats, rank, sleepers[rank].pid, laps, meter.DATA if rank == 1 else meter.FORWARD, age=10)
    dog = watchdog.Watchdog(beats, 5.0, run_dir, "t")
    report = dog.check(time.monotonic())
    assert report is not None and report.laggard.rank == 1
    assert "rank 1" in report.line() and "after step 10, in forward/backward" in report.line()
    assert [r.state for r in report.ranks][2].startswith("stopped")
    for p in sleepers:
        assert p.wait(timeout=10) == -signal.SIGKILL
    assert json.loads((run_dir / "status.json").read_text())["outcome"] == "hung"
    written = sorted(p.name for p in report.directory.iterdir())
    assert len([n for n in written if n.endswith(".txt") and "rank" in n]) == 3 and "summary.txt" in written
    assert dog.check(time.monotonic()) is None  # the attempt it acted on is not judged twice


def test_a_tie_goes_to_the_stopped_rank_and_long_phases_get_more_time(
        tmp_path: Path, sleepers: list[subprocess.Popen[bytes]], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(watchdog, "python_stacks", lambda _dir, rank: "")
    dog = watchdog.Watchdog(tmp_path, 5.0, tmp_path / "run", "t")
    _write_beat(tmp_path, 0, sleepers[0].pid, 30, protocol.SAVING, age=12)  # a save: 3 x 5 s allowed
    _write_beat(tmp_path, 1, sleepers[1].pid, 30, protocol.SAVING, age=12)
    _write_beat(tmp_path, 2, sleepers[2].pid, 30, protocol.STARTING, age=1000, done=0)  # start-up: never judged
    assert dog.check(time.monotonic()) is None
    os.kill(sleepers[1].pid, signal.SIGSTOP)
    _wait_stopped(sleepers[1].pid)  # the kernel stops it asynchronously
    report = dog.check(time.monotonic() + 4)
    assert report is not None and report.laggard.rank == 1 and report.laggard.stopped


# ---------------------------------------------------------------- real jobs


def _start(run_dir: Path, nproc: int, *extra: str, restarts: int = 0, **env: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "hpctrain", "run", "-n", str(nproc), f"--max-restarts={restarts}",
           f"--hang-timeout={HANG_S}", "train", *TINY, f"run.dir={run_dir}", *extra]
    return subprocess.Popen(cmd, cwd=preempt.ROOT, env=launch_env(**env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)


def _rank_pid(launcher: int, rank: int) -> int:
    for pid in preempt._workers(launcher):
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in environ:
            return pid
    pytest.fail(f"no rank {rank} under launcher {launcher}")


def _hang_summary(run_dir: Path) -> str:
    found = sorted(run_dir.glob("hang-*/summary.txt"))
    assert len(found) == 1, found
    return found[0].read_text()


def _finish_within_bound(proc: subprocess.Popen[bytes], stalled_at: float) -> tuple[int, str]:
    code, out = finish_launch(proc, timeout=HANG_S * 3 + 60)
    assert time.monotonic() - stalled_at < HANG_S + 30, out[-3000:]
    return code, out


def test_a_deadlock_in_user_code_is_named_and_restarted_in_place(tmp_path: Path) -> None:
    """Rank 1's model deadlocks at its 5th training forward (first attempt only): the watchdog
    names rank 1 in forward/backward with the user's frame in its stacks, ends the ranks, and
    torchrun's restart resumes from the last committed checkpoint to the end."""
    run_dir = tmp_path / "run"
    proc = _start(run_dir, 2, "model.name=tests.user_models:deadlocking_mlp", restarts=1,
                  HPCTRAIN_TEST_STALL_RANK="1", HPCTRAIN_TEST_STALL_AT="5")
    code, out = finish_launch(proc, timeout=180)
    assert code == 0, out[-4000:]
    summary = _hang_summary(run_dir)
    assert "hang: rank 1 " in summary and "after step 4, in forward/backward" in summary, summary
    stacks = next(run_dir.glob("hang-*/*-rank-1.txt")).read_text()
    assert 'user_models.py", line' in stacks and "in forward" in stacks, stacks[-2000:]  # faulthandler's
    assert "resumed from" in out and json.loads((run_dir / "status.json").read_text())["outcome"] == "finished"


@pytest.mark.parametrize("nproc,stopped", [(3, 1)])
def test_a_stopped_rank_ends_the_job_with_exit_4(tmp_path: Path, nproc: int, stopped: int) -> None:
    run_dir = tmp_path / "run"
    proc = _start(run_dir, nproc, "model.name=tests.user_models:slow_mlp")
    preempt._wait_for_step(run_dir, 5, proc)
    committed = layout.committed(run_dir / "checkpoints")
    os.kill(_rank_pid(proc.pid, stopped), signal.SIGSTOP)
    code, out = _finish_within_bound(proc, time.monotonic())
    assert code == EXIT_HUNG, out[-4000:]
    summary = _hang_summary(run_dir)
    assert f"hang: rank {stopped} " in summary and "process stopped" in summary, summary
    assert f"hang: rank {stopped} " in out
    assert all(path.exists() for _, path in committed) and layout.newest_valid(run_dir / "checkpoints") is not None


def test_a_stopped_data_worker_names_its_rank(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = _start(run_dir, 2, "model.name=tests.user_models:slow_mlp", "data.num_workers=1")
    preempt._wait_for_step(run_dir, 3, proc)
    workers = preempt._workers(_rank_pid(proc.pid, 0))
    assert len(workers) == 1, workers
    os.kill(workers[0], signal.SIGSTOP)
    code, out = _finish_within_bound(proc, time.monotonic())
    assert code == EXIT_HUNG, out[-4000:]
    summary = _hang_summary(run_dir)
    assert "hang: rank 0 " in summary and "loading the next batch" in summary, summary
