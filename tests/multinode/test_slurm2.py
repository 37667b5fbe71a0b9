"""A real 2-node Slurm (node1 and node2 are network namespaces with their own addresses and hostnames):
the job `hpctrain slurm --nodes 2 --submit` writes runs one rank per node over c10d rendezvous; preempted
with `scancel --signal=USR1 --batch` after its first checkpoint, it is requeued, resumes on both nodes and
ends bit-identical to one node with two ranks (which an uninterrupted 2-node job is a fortiori: one job
covers both, to keep the suite short)."""

from __future__ import annotations

import pytest

from tests.slurm.cluster import (
    SLOW,
    STEPS,
    Up,
    assert_preempted_and_resumed,
    job_field,
    job_logs,
    preempt_after_first_checkpoint,
    submit,
    summary,
    wait_finished,
)

pytestmark = [pytest.mark.multinode, pytest.mark.slurm, pytest.mark.slow]
TWO_NODES = ("--nodes", "2", "--nproc-per-node", "1", "--cpus-per-task", "1")


def _check_two_node_run(slurm2: Up, run_dir, job: str, reference) -> str:
    logs = job_logs(run_dir, job)
    assert job_field(slurm2, job, "NodeList") == "node[1-2]", logs[-4000:]
    got = summary(run_dir)
    assert got["steps"] == STEPS and got["world_size"] == 2, logs[-4000:]
    assert got["params_sha256"] == reference["params_sha256"]
    return logs


def test_two_node_job_preempted_requeued_resumes_bit_identical(slurm2, reference, tmp_path):
    run_dir = tmp_path / "run"
    job = submit(slurm2, run_dir, SLOW, *TWO_NODES)
    try:
        preempt_after_first_checkpoint(slurm2, run_dir, job)
        state = wait_finished(slurm2, job)
    finally:
        slurm2.run("scancel", job, check=False)
    assert state == "COMPLETED", job_logs(run_dir, job)[-4000:]
    assert job_field(slurm2, job, "Restarts") == "1"
    assert_preempted_and_resumed(_check_two_node_run(slurm2, run_dir, job, reference))
