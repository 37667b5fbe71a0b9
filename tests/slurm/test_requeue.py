"""Preemption on a real single-node Slurm, through the job `hpctrain slurm --submit` writes: USR1 to the batch
shell (what `--signal=B:USR1@T` and `scancel --signal=USR1 --batch` do) -> its trap forwards USR1 to the job
step -> `hpctrain run` forwards it to both ranks -> they agree, save and exit 3 -> the script requeues the
job -> the requeued job resumes and ends with the same weights as an uninterrupted run."""

from __future__ import annotations

import pytest

from tests.slurm.cluster import (
    SLOW,
    STEPS,
    assert_preempted_and_resumed,
    job_field,
    job_logs,
    preempt_after_first_checkpoint,
    submit,
    summary,
    wait_finished,
)

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def test_usr1_saves_requeues_and_resumes_bit_identical(slurm, reference, tmp_path):
    run_dir = tmp_path / "run"
    job = submit(slurm, run_dir, SLOW, "--nodes", "1", "--nproc-per-node", "2", "--cpus-per-task", "2")
    try:
        preempt_after_first_checkpoint(slurm, run_dir, job)
        state = wait_finished(slurm, job)
    finally:
        slurm.run("scancel", job, check=False)
    logs = job_logs(run_dir, job)
    assert state == "COMPLETED", logs[-4000:]
    assert job_field(slurm, job, "Restarts") == "1", logs[-4000:]
    assert_preempted_and_resumed(logs)
    got = summary(run_dir)
    assert got["steps"] == STEPS and got["world_size"] == 2
    assert got["params_sha256"] == reference["params_sha256"]
