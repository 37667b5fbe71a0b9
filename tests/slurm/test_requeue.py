"""Preemption on a real single-node Slurm, through the job `hpctrain slurm --signal SIG --submit` writes, for
each signal it offers: SIG to the batch shell (what `--signal=B:SIG@T` and `scancel --signal=SIG --batch` do) ->
its trap hands SIG to the job step (USR1/USR2 through srun, HUP/TERM through scancel: srun would turn those into
SIGKILL) -> `hpctrain run` forwards it to the rank, whose checkpoint.signals hold it -> it saves and exits 3 ->
the script requeues the job -> the requeued job resumes and ends with the same weights as an uninterrupted run.

Cheap on purpose: one tiny 1-rank job per forwarding path, all submitted at once, each signalled as soon as it
trains; 2 ranks on 2 nodes: tests/multinode/test_slurm2.py. The TERM job also checks the CPUs srun gives the rank
(it takes both of a 2-CPU test node, so the other job runs while it waits for its requeue, or after it)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from hpctrain.launch.slurm import SIGNALS
from tests.dist_utils import ROOT
from tests.slurm.cluster import FAST, JOB, Up, job_field, job_logs, submit, summary, wait_finished, wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

STEPS = 200  # 4 s of slow_mlp's 20 ms steps: a job is still training when its signal comes
TINY = (f"train.max_steps={STEPS}", "checkpoint.every_steps=null")  # only the signal saves
# One job per forwarding path, to keep the suite short: TERM through scancel here, HUP through
# scancel to a user's own script (the last test), USR1 through srun in the 2-node job of
# tests/multinode/test_slurm2.py (USR2 takes the same path: tests/launch/test_slurm_render.py runs
# each signal through the batch shell). The TERM job keeps the default --signal USR1: TERM is what
# a preemption with a grace time (or an admin's scancel) sends every process of a job, the batch
# shell included, which traps it as well as USR1 (issue 38, point 5).
TRAIN_SIGNALS = ("TERM",)
# ... and it asks for 2 CPUs per task, which srun must hand to the step: Slurm 22.05-23.02's srun does
# not take sbatch's --cpus-per-task, so a step that gets only what it asks for (SLURM_EXACT=1, as sites
# set it, or --exact) got one CPU. The rank's CPU affinity shows it (the test cluster binds tasks:
# TaskPlugin=task/affinity), and so does SLURM_CPUS_ON_NODE in its environment (the step's CPUs).
CPUS = 2
REPORTING = "model.name=tests.slurm.affinity_model:slow_mlp_reporting"  # slow_mlp, recording its affinity
assert set(TRAIN_SIGNALS) | {"HUP", "USR1", "USR2"} == set(SIGNALS)


@dataclass
class Job:
    run_dir: Path
    job_id: str
    state: str = ""
    restarts: str = ""


def _trained(run_dir: Path) -> int:
    try:
        rows = (run_dir / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return 0
    return max((json.loads(r).get("step", 0) for r in rows if r.endswith("}")), default=0)


def _signal_those_training(up: Up, waiting: dict[str, Job]) -> bool:
    """Send each job still waiting its signal once it has trained a few steps; True when none is left."""
    for sig, job in list(waiting.items()):
        if (_script_trained if sig == "script" else _trained)(job.run_dir) >= 10:
            up.run("scancel", f"--signal={'HUP' if sig == 'script' else sig}", "--batch", job.job_id)
            del waiting[sig]
    return not waiting


def _submit_script(up: Up, run_dir: Path) -> str:
    """A user's own script (examples/own_loop.py, hpctrain's Checkpointer inside) as `hpctrain slurm
    --signal HUP ... -- SCRIPT ARGS` submits it: its checkpointer must follow the job's HUP."""
    cmd = [sys.executable, "-m", "hpctrain", "slurm", "--nodes", "1", "--nproc-per-node", "1", "--time", "00:10:00",
           "--max-requeues", "2", "--signal", "HUP", "--run-dir", str(run_dir), "--submit", "--",
           "examples/own_loop.py", str(run_dir / "out"), "--pause", "0.05"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=up.env, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = re.search(r"submitted job (\d+)", proc.stdout)
    assert found, proc.stdout
    return found.group(1)


def _script_trained(run_dir: Path) -> int:
    return 10 if (run_dir / "out" / "checkpoints" / "step-000000010" / "manifest.json").is_file() else 0


@pytest.fixture(scope="module")
def jobs(slurm: Up, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Job]:
    """One job per signal, each preempted once while it trains, then left to finish; and a user's
    own script under --signal HUP."""
    root = tmp_path_factory.mktemp("signals")
    submitted = {sig: Job(root / sig, submit(slurm, root / sig, REPORTING, "--nodes", "1", "--nproc-per-node", "1",
                                             "--cpus-per-task", str(CPUS), "--mem", "1G",
                                             "--setup", "export SLURM_EXACT=1", "--env",
                                             f"HPCTRAIN_TEST_AFFINITY_DIR={root / f'{sig}-affinity'}", config=TINY))
                 for sig in TRAIN_SIGNALS}
    submitted["script"] = Job(root / "script", _submit_script(slurm, root / "script"))
    try:
        waiting = dict(submitted)
        wait_for(lambda: _signal_those_training(slurm, waiting), 300, f"jobs {sorted(waiting)} to train")
        for job in submitted.values():
            job.state = wait_finished(slurm, job.job_id)
            job.restarts = job_field(slurm, job.job_id, "Restarts")
    finally:
        for job in submitted.values():
            slurm.run("scancel", job.job_id, check=False)
    return submitted


@pytest.fixture(scope="module")
def reference_one_rank(tmp_path_factory: pytest.TempPathFactory) -> str:
    """params_sha256 of the same job uninterrupted, trained in this process (world size 1 either way)."""
    from hpctrain.config import load_config
    from hpctrain.train import train

    run_dir = tmp_path_factory.mktemp("reference-one-rank") / "run"
    return str(train(load_config(None, [FAST, *JOB, *TINY, f"run.dir={run_dir}"]))["params_sha256"])


@pytest.mark.parametrize("sig", TRAIN_SIGNALS)
def test_each_signal_saves_requeues_and_resumes_bit_identical(jobs: dict[str, Job], reference_one_rank: str,
                                                              sig: str) -> None:
    job = jobs[sig]
    logs = job_logs(job.run_dir, job.job_id)
    assert job.state == "COMPLETED" and job.restarts == "1", logs[-4000:]
    assert f"hpctrain: {sig} at " in logs and "hpctrain: requeue 1 of 2" in logs, logs[-4000:]
    saved = re.findall(r"preempted: checkpoint \S+ committed at step (\d+)", logs)
    assert len(saved) == 1 and 10 <= int(saved[0]) < STEPS, logs[-4000:]
    assert re.search(rf"resumed from \S+ \(step {saved[0]}\b", logs), logs[-4000:]
    got = summary(job.run_dir)
    assert got["steps"] == STEPS and got["world_size"] == 1
    assert got["params_sha256"] == reference_one_rank


def test_the_ranks_get_the_cpus_per_task_before_and_after_the_requeue(jobs: dict[str, Job]) -> None:
    """srun --cpus-per-task (and SRUN_CPUS_PER_TASK): the rank may run on CPUS cores, not the one
    Slurm 22.05's srun gives a step that gets what it asks for (without them: affinity [0],
    SLURM_CPUS_ON_NODE 1), and its threads follow (OMP_NUM_THREADS)."""
    job = jobs["TERM"]
    seen = [json.loads(p.read_text()) for p in sorted((job.run_dir.parent / "TERM-affinity").glob("rank*.json"))]
    assert {s["restart"] for s in seen} == {"0", "1"}, seen  # the first start and the requeued one
    for rank in seen:
        assert len(rank["affinity"]) == CPUS and rank["slurm_cpus_on_node"] == str(CPUS), seen
        assert rank["omp_num_threads"] == str(CPUS), seen


def test_a_users_script_is_preempted_requeued_and_finishes(jobs: dict[str, Job]) -> None:
    """hpctrain slurm -- examples/own_loop.py with --signal HUP: the script's own checkpointer saves on
    HUP (HPCTRAIN_SIGNALS), hpctrain run exits 3, the job requeues once and the script finishes,
    validating every sample once."""
    job = jobs["script"]
    logs = job_logs(job.run_dir, job.job_id)
    assert job.state == "COMPLETED" and job.restarts == "1", logs[-4000:]
    assert "hpctrain: HUP at " in logs and "hpctrain: requeue 1 of 2" in logs, logs[-4000:]
    result = json.loads([line for line in logs.splitlines() if line.startswith('{"accuracy"')][-1])
    assert result["count"] == 188 and result["steps"] == 96  # 3 epochs x 512 / 16 at one rank
