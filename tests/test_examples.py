"""examples/own_loop.py, a user's loop from the public parts only (``import hpctrain``), run as users
run it (torchrun, 2 gloo ranks, DDP) and sharded (FSDP) under `hpctrain run`: exact validation of
every sample once; the meter books each phase of a step; a preemption signal ends in a committed save
and exit 3, SIGKILL loses nothing committed, and the same command resumes bit for bit after each."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.dist_utils import ROOT, _descendants, launch_env

pytestmark = pytest.mark.slow  # launches or several ranks: scheduled first (tests/conftest.py)
EXAMPLE = ROOT / "examples" / "own_loop.py"
VAL_SAMPLES = 188  # 700 samples, 512 for training


def _start(run: Path, *extra: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(EXAMPLE),
           str(run), *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=launch_env(),
                            cwd=ROOT, start_new_session=True)


def _finish(proc: subprocess.Popen[str], timeout: float = 240) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def _result(out: str) -> dict:
    return json.loads([line for line in out.splitlines() if line.startswith("{")][-1])


def _wait_for(path: Path, proc: subprocess.Popen[str], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"ended before {path} appeared:\n{proc.communicate()[0][-3000:]}"
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    code, out = _finish(_start(tmp_path_factory.mktemp("own") / "run"))
    assert code == 0, out[-3000:]
    return _result(out)


def test_own_loop_validates_every_sample_once(reference: dict) -> None:
    assert reference["count"] == VAL_SAMPLES and reference["steps"] == 48  # 3 epochs x 512 / (16 x 2)
    assert reference["accuracy"] > 0.8  # two separable blobs
    # meter.data() / compute() / optimizer() / checkpoint(): each phase booked where it ran (never a
    # whole step as data time); no validation inside the loop
    assert all(reference[f"time_{phase}_s"] > 0 for phase in ("data", "fwd_bwd", "optim", "ckpt", "other"))
    assert reference["time_eval_s"] == 0.0


def test_own_loop_imports_hpctrain_only() -> None:
    """One import line; every name the loop uses is hpctrain's public API (hpctrain/__init__.py)."""
    import ast
    import re

    import hpctrain

    source = EXAMPLE.read_text()
    imports = [n for n in ast.walk(ast.parse(source)) if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert [ast.unparse(n) for n in imports if "hpctrain" in ast.unparse(n)] == ["import hpctrain"]
    used = set(re.findall(r"\bhpctrain\.(\w+)", source))
    assert used <= set(hpctrain.__all__) and len(used) <= 10, sorted(used)


def _exact(result: dict) -> dict:
    """A result without its timings (the meter's figures differ run to run)."""
    return {k: v for k, v in result.items() if not k.startswith(("time_", "samples_per_s"))}


def _start_hpctrain_run(run: Path, *extra: str) -> subprocess.Popen[str]:
    """The same script through `hpctrain run -n 2 python SCRIPT.py ARGS` (what hpctrain slurm's job runs)."""
    cmd = [sys.executable, "-m", "hpctrain", "run", "-n", "2", "--hang-timeout", "60", "python", str(EXAMPLE),
           str(run), *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=launch_env(),
                            cwd=ROOT, start_new_session=True)


def _sigkill_all(proc: subprocess.Popen[str]) -> None:
    """The launcher and everything it started, as the OOM killer would."""
    victims = _descendants(proc.pid)
    os.killpg(proc.pid, signal.SIGKILL)
    for pid in victims:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.communicate(timeout=60)


def test_own_loop_sharded_preempted_then_sigkilled_resumes_bit_identical(tmp_path: Path, reference: dict) -> None:
    """A user's sharded (FSDP) script under `hpctrain run`: SIGUSR1 to the launcher (as Slurm's trap
    forwards it) reaches both ranks, they save the same step (sharded, DCP), and the launcher exits
    with exactly 3 (the ranks recorded their preemption save). The same command resumes; SIGKILLed
    after its next save, it resumes again from that one, and ends bit for bit as the uninterrupted
    DDP run under torchrun (two ranks' gradients averaged either way: the same bits)."""
    run = tmp_path / "run"
    proc = _start_hpctrain_run(run, "--strategy", "fsdp", "--pause", "0.05")
    _wait_for(run / "checkpoints" / "step-000000010" / "manifest.json", proc)
    os.kill(proc.pid, signal.SIGUSR1)
    code, out = _finish(proc)
    assert code == 3, out[-3000:]
    proc = _start_hpctrain_run(run, "--strategy", "fsdp", "--pause", "0.05")
    _wait_for(run / "checkpoints" / "step-000000020" / "manifest.json", proc)
    _sigkill_all(proc)
    code, out = _finish(_start_hpctrain_run(run, "--strategy", "fsdp"))
    assert code == 0, out[-3000:]
    assert _exact(_result(out)) == _exact(reference)
