"""A real single-node Slurm for the tests in this folder (root only; skipped elsewhere).

Brought up once per session by the workplace's idempotent setup script (Debian's
slurmctld + slurmd + munge, ~10 s), and left running: other sessions reuse it."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

SETUP = Path(__file__).resolve().parents[3] / "shared" / "slurm" / "setup.sh"


@pytest.fixture(scope="session")
def slurm() -> None:
    if os.geteuid() != 0:
        pytest.skip("a test Slurm needs root (apt-get install, daemons)")
    if not SETUP.is_file() and not shutil.which("sbatch"):
        pytest.skip(f"no Slurm: neither sbatch nor {SETUP}")
    if SETUP.is_file():
        proc = subprocess.run(["bash", str(SETUP)], capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            pytest.fail(f"Slurm setup failed:\n{proc.stdout}\n{proc.stderr}")
    elif subprocess.run(["scontrol", "ping"], capture_output=True, text=True).stdout.count("UP") == 0:
        pytest.skip(f"Slurm is installed but its controller is down, and {SETUP} is not there to start it")


def sbatch(script: Path, *args: str) -> str:
    out = subprocess.run(["sbatch", "--parsable", *args, str(script)], capture_output=True, text=True, check=True)
    return out.stdout.strip().split(";")[0]


def job_state(job_id: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True)
    for field in out.stdout.split():
        if field.startswith("JobState="):
            return field.split("=", 1)[1]
    return "UNKNOWN"


def wait_for(predicate, timeout: float, what: str, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
