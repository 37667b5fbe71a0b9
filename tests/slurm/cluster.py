"""The project's own test clusters (scripts/testcluster/*.sh) as pytest helpers, shared by tests/slurm and
tests/multinode: bring-up with skip reasons, Slurm commands against a private SLURM_CONF, and the one
1-node reference run that every cluster job is compared with."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts" / "testcluster"
T = TypeVar("T")

# One tiny job for every cluster test: equal threads per rank (train.threads=1) so that 2 nodes x 1 rank and
# 1 node x 2 ranks do the same arithmetic; tests.user_models:slow_mlp is tiny_mlp (same weights) with 20 ms steps,
# for the tests that must signal a run while it is surely still training.
STEPS = 600
JOB = ["data.name=synthetic_tiny", "data.synthetic_size=2048", "data.batch_size=16", "data.max_val_samples=64",
       "train.epochs=100", f"train.max_steps={STEPS}", "train.log_every=10", "train.progress=false",
       "train.eval_each_epoch=false", "train.threads=1", "checkpoint.every_seconds=null", "checkpoint.every_steps=100",
       "seed=3"]
FAST, SLOW = "model.name=tests.user_models:tiny_mlp", "model.name=tests.user_models:slow_mlp"


def base_env() -> dict[str, str]:
    """This environment without launcher or Slurm variables, with the repo importable (tests.user_models)."""
    # GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME: tests/dist_utils.py pins gloo to `lo` for the
    # one-host tests; inherited here, ranks on two hosts would offer each other 127.0.0.1
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "SLURM_", "TORCHELASTIC_", "GROUP_RANK",
                                "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"))}
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}".rstrip(os.pathsep)
    return env


def skip_unless_root(what: str) -> None:
    if os.geteuid() != 0:
        pytest.skip(f"{what} needs root (installs packages, starts daemons, creates namespaces)")


@dataclass
class Up:
    """What a bring-up script left running; ``started`` = this session started it (and tears it down)."""

    started: bool
    env: dict[str, str] = field(default_factory=base_env)

    def run(self, *cmd: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(cmd, capture_output=True, text=True, env=self.env, check=check, timeout=timeout)


UNABLE = 3  # the scripts' exit status for "this machine cannot host it" (not root, no apt, no namespaces)


def bring_up(script: str, *args: str) -> Up:
    """Run SCRIPT; skip with its reason when the machine cannot host the cluster, fail on any other error."""
    proc = subprocess.run(["bash", str(SCRIPTS / script), *args], capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    if proc.returncode == UNABLE:
        pytest.skip(f"{script} {' '.join(args)}: {(proc.stderr.strip().splitlines() or ['cannot run here'])[-1]}")
    if proc.returncode != 0:
        pytest.fail(f"{script} {' '.join(args)} failed (exit {proc.returncode}):\n{out[-4000:]}")
    up = Up(started="already up" not in out)
    for line in proc.stdout.splitlines():
        if line.startswith("SLURM_CONF="):
            up.env["SLURM_CONF"] = line.split("=", 1)[1]
    return up


def tear_down(up: Up, script: str, *args: str) -> None:
    if up.started:
        subprocess.run(["bash", str(SCRIPTS / script), *args], capture_output=True, timeout=120)


def cluster(up_script: str, down_script: str, up_args: tuple[str, ...] = (),
            down_args: tuple[str, ...] = ()) -> Iterator[Up]:
    """Body of a session fixture: what UP_SCRIPT brings up, torn down at the end if this session started it."""
    skip_unless_root(up_script)
    up = bring_up(up_script, *up_args)
    yield up
    tear_down(up, down_script, *down_args)


def job_field(up: Up, job_id: str, name: str) -> str:
    out = up.run("scontrol", "show", "job", job_id, check=False).stdout
    for item in out.split():
        if item.startswith(name + "="):
            return item.split("=", 1)[1]
    return "UNKNOWN"


def wait_for(predicate: Callable[[], T], timeout: float, what: str, interval: float = 0.5) -> T:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def checkpoint_steps(run_dir: Path) -> list[int]:
    """Committed checkpoints only (``step-N``; not ``.partial-step-N`` or ``superseded-step-N``)."""
    names = (re.fullmatch(r"step-(\d+)", p.name) for p in (run_dir / "checkpoints").glob("step-*"))
    return sorted(int(m.group(1)) for m in names if m)


def summary(run_dir: Path) -> dict[str, object]:
    return json.loads((run_dir / "summary.json").read_text())


_REFERENCE: dict[str, dict[str, object]] = {}


def reference_summary(tmp_root: Path) -> dict[str, object]:
    """summary.json of ``hpctrain run -n 2 train JOB`` on this host (computed once per session)."""
    if "ref" not in _REFERENCE:  # one per session: tests/slurm and tests/multinode both compare with it
        run_dir = tmp_root / "reference"
        proc = subprocess.run([sys.executable, "-m", "hpctrain", "run", "-n", "2", "train", FAST, *JOB,
                               f"run.dir={run_dir}"], capture_output=True, text=True, env=base_env(), cwd=ROOT,
                              timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        _REFERENCE["ref"] = summary(run_dir)
        assert _REFERENCE["ref"]["steps"] == STEPS
    return _REFERENCE["ref"]


def submit(up: Up, run_dir: Path, model: str, *options: str, config: tuple[str, ...] = ()) -> str:
    """``hpctrain slurm MODEL JOB CONFIG run.dir=RUN_DIR OPTIONS --submit`` on cluster UP; returns the job id."""
    proc = subprocess.run([sys.executable, "-m", "hpctrain", "slurm", model, *JOB, *config, f"run.dir={run_dir}",
                           "--time", "00:10:00", "--max-requeues", "2", *options, "--submit"],
                          capture_output=True, text=True, env=up.env, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = re.search(r"submitted job (\d+)", proc.stdout)
    assert found, proc.stdout
    return found.group(1)


def wait_finished(up: Up, job_id: str, timeout: float = 300) -> str:
    """Wait until the job has left the queue for good; returns its final JobState."""
    final = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")

    def ended() -> str:
        state = job_field(up, job_id, "JobState")
        return state if state in final else ""

    return wait_for(ended, timeout, f"job {job_id} to end")


def job_logs(run_dir: Path, job_id: str) -> str:
    """The job's stdout then stderr (Slurm appends across requeues: --open-mode=append)."""
    return "".join(p.read_text() for p in (run_dir / f"slurm-{job_id}.out", run_dir / f"slurm-{job_id}.err")
                   if p.is_file())


def preempt_after_first_checkpoint(up: Up, run_dir: Path, job_id: str) -> None:
    """What a preemption warning does: USR1 to the batch shell once a periodic checkpoint is committed."""
    wait_for(lambda: checkpoint_steps(run_dir), 240, "the first checkpoint")
    assert job_field(up, job_id, "JobState") == "RUNNING"
    up.run("scancel", "--signal=USR1", "--batch", job_id)


def assert_preempted_and_resumed(logs: str) -> None:
    """The ranks saved at the preemption (after the first periodic checkpoint) and the requeued job resumed there."""
    saved = re.findall(r"preempted: checkpoint \S+ committed at step (\d+)", logs)
    assert len(saved) == 1 and 100 <= int(saved[0]) < STEPS, logs[-4000:]
    assert re.search(rf"resumed from \S+ \(step {saved[0]}\b", logs), logs[-4000:]
