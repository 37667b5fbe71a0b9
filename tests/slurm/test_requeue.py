"""Preemption on a real Slurm: USR1 to the batch shell -> trap -> SIGTERM to `hpctrain run`
-> ranks agree and save -> exit 3 -> the script requeues itself -> the requeued job
resumes and finishes with the same weights as an uninterrupted run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.slurm.conftest import job_state, sbatch, wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
JOB = ["model.name=tests.models:slow_mlp", "data.name=synthetic_tiny", "data.synthetic_size=4096",
       "data.batch_size=16", "train.max_steps=120", "train.log_every=1", "train.progress=false",
       "train.eval_each_epoch=false", "checkpoint.every_seconds=null", "seed=3"]

SCRIPT = """#!/bin/bash
#SBATCH --job-name=hpctrain-requeue --nodes=1 --ntasks=1 --cpus-per-task=2
#SBATCH --requeue --open-mode=append --output={log}
# The documented pattern (docs/checkpointing.md), on one node: Slurm's warning reaches the
# batch shell only (B:), the trap forwards SIGTERM to torchrun, which forwards it to the ranks.
echo "start restart_count=${{SLURM_RESTART_COUNT:-0}}"
on_warning() {{ kill -TERM "$child" 2>/dev/null; }}
trap on_warning USR1
{python} -m hpctrain run -n 2 train {args} run.dir={run_dir} &
child=$!
wait "$child"; code=$?
if [ "$code" -gt 128 ]; then wait "$child"; code=$?; fi   # the trap interrupted the first wait
echo "hpctrain exit $code"
if [ "$code" -eq 3 ]; then scontrol requeue "$SLURM_JOB_ID"; fi
exit "$code"
"""


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def test_usr1_saves_requeues_and_resumes_bit_identical(slurm, tmp_path):
    reference = tmp_path / "reference"
    subprocess.run([sys.executable, "-m", "hpctrain", "run", "-n", "2", "train", *JOB, f"run.dir={reference}"],
                   check=True, capture_output=True, env=_env(), cwd=ROOT, timeout=300)

    run_dir, log = tmp_path / "slurm-run", tmp_path / "job.log"
    script = tmp_path / "job.sbatch"
    script.write_text(SCRIPT.format(log=log, python=sys.executable, args=" ".join(JOB), run_dir=run_dir))
    job = sbatch(script, f"--chdir={ROOT}", "--export=ALL,PYTHONPATH=" + str(ROOT))
    try:
        metrics = run_dir / "metrics.jsonl"
        wait_for(lambda: metrics.is_file() and len(metrics.read_text().splitlines()) >= 10, 180, "training steps")
        subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True)
        wait_for(lambda: (run_dir / "summary.json").is_file() and job_state(job) in ("COMPLETED", "UNKNOWN"),
                 300, "the requeued job to finish")
    finally:
        subprocess.run(["scancel", job], capture_output=True)
    text = log.read_text()
    assert "hpctrain exit 3" in text and "start restart_count=1" in text, text
    assert "hpctrain exit 0" in text, text
    steps = sorted(int(p.name.split("-")[1]) for p in (run_dir / "checkpoints").glob("step-*"))
    assert steps and 10 <= steps[0] < 120, steps  # a preemption checkpoint mid-run, then the final one
    got = json.loads((run_dir / "summary.json").read_text())
    want = json.loads((reference / "summary.json").read_text())
    assert got["steps"] == want["steps"] == 120
    assert got["params_sha256"] == want["params_sha256"]
