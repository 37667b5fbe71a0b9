"""One rank fails, every rank fails: the resume and eval phases that end in a collective.

Ranks are plain processes (no torchrun: nothing would kill the survivors), started with
the torchrun-style variables RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT or with the
Slurm variables of an srun step. A failure is injected on one rank; every rank must exit
non-zero with the failing rank's message, without a traceback. The subprocess timeout is
only the hang guard: a hang fails the test.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

import pytest

from hpctrain.checkpoint import layout
from hpctrain.checkpoint.state import REPLICATED_TENSORS
from hpctrain.config import load_config
from hpctrain.train import train
from tests.dist_utils import free_port, launch_env

pytestmark = pytest.mark.slow  # launches or several ranks: scheduled first (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]
HANG_GUARD_S = 300  # a hang, not a slow machine: 5x the quiet ~20 s of the slowest case, and more
BASE = ["model.name=tests.ckpt_models:tiny_mlp", "data.name=synthetic_tiny", "data.synthetic_size=128",
        "data.batch_size=16", "data.max_val_samples=32", "train.epochs=1", "train.progress=false",
        "checkpoint.every_seconds=None", "train.threads=1"]

# Runs the CLI after replacing MODULE:ATTR (ATTR may be Class.method) by a version that
# raises a RunError on one rank and calls the original on the others.
INJECT = """
import importlib, os, sys
from hpctrain.core.errors import RunError
target, bad_rank = sys.argv[1], int(sys.argv[2])
module, _, attr = target.partition(":")
owner = importlib.import_module(module)
*path, name = attr.split(".")
for part in path:
    owner = getattr(owner, part)
original = getattr(owner, name)
def failing(*args, **kwargs):
    if int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))) == bad_rank:
        raise RunError(f"injected failure in {name} on rank {bad_rank}")
    return original(*args, **kwargs)
setattr(owner, name, failing)
from hpctrain.cli import main
sys.exit(main(sys.argv[3:]))
"""


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished single-process run: checkpoints/step-000000008 and model.pt."""
    run = tmp_path_factory.mktemp("agree") / "run"
    train(load_config(None, [*BASE, f"run.dir={run}"]))
    return run


def _rank_env(rank: int, world: int, port: int, launcher: str) -> dict[str, str]:
    env = launch_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if launcher == "plain":  # what torchrun would set, without torchrun
        env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    else:  # the variables of a plain `srun -n WORLD` step
        env.update(SLURM_PROCID=str(rank), SLURM_NTASKS=str(world), SLURM_LOCALID=str(rank), SLURM_NNODES="1",
                   SLURM_NODEID="0", SLURM_STEP_ID="0", SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="127.0.0.1",
                   SLURM_TASKS_PER_NODE=str(world))
    return env


def _run_ranks(world: int, args: list[str], inject: tuple[str, int] | None = None,
               launcher: str = "plain") -> list[tuple[int, str]]:
    """Start ``world`` ranks of ``hpctrain ARGS``; returns (exit code, output) per rank."""
    port = free_port()
    prefix = [sys.executable, "-c", INJECT, inject[0], str(inject[1])] if inject else \
        [sys.executable, "-m", "hpctrain"]
    # Output goes to files, not pipes: a rank blocked writing into a full pipe that nobody
    # reads yet (the ranks are waited for in turn) would hold the others in a collective.
    logs = [tempfile.TemporaryFile() for _ in range(world)]
    procs = [subprocess.Popen([*prefix, *args], cwd=ROOT, env=_rank_env(r, world, port, launcher),
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
             for r, log in enumerate(logs)]
    deadline = time.monotonic() + HANG_GUARD_S
    try:
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):  # a rank that already ended: kill the others still
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        pytest.fail("ranks hung after one failed:\n" + "\n---\n".join(_read(log)[-2000:] for log in logs))
    return [(proc.returncode, _read(log)) for proc, log in zip(procs, logs)]


def _read(log: IO[bytes]) -> str:
    log.seek(0)
    return log.read().decode(errors="replace")


def _all_fail_with(results: list[tuple[int, str]], message: str) -> None:
    codes = {code for code, _ in results}
    assert len(codes) == 1 and codes != {0}, [(code, out[-1500:]) for code, out in results]
    for _, out in results:
        assert message in out, out[-2000:]
        assert "Traceback" not in out, out[-3000:]


def test_rank0_failing_to_pick_the_resume_checkpoint_fails_all_ranks(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-run"
    results = _run_ranks(3, ["train", *BASE, f"run.dir={tmp_path / 'run'}", f"resume={missing}"])
    _all_fail_with(results, f"{missing} holds no committed checkpoint")
    assert "choosing the checkpoint to resume failed on rank 0" in results[1][1]


@pytest.mark.parametrize("launcher", ["plain", "slurm"])
def test_rank0_failing_to_verify_the_resume_checkpoint_fails_all_ranks(trained: Path, tmp_path: Path,
                                                                       launcher: str) -> None:
    ckpt = layout.committed(trained / "checkpoints")[-1][1]
    results = _run_ranks(2, ["train", *BASE, f"run.dir={tmp_path / 'run'}", f"resume={ckpt}"],
                         inject=("hpctrain.checkpoint.checkpointer:Checkpointer._read", 0), launcher=launcher)
    _all_fail_with(results, "injected failure in _read on rank 0")


def test_corrupt_resume_checkpoint_fails_every_rank_alike(trained: Path, tmp_path: Path) -> None:
    """Found by the one-pass read (each rank reads the tensor file into its live model)."""
    copy = tmp_path / "ckpt"
    ckpt = layout.committed(trained / "checkpoints")[-1][1]
    copy.mkdir()
    for file in ckpt.iterdir():
        (copy / file.name).write_bytes(file.read_bytes())
    data = bytearray((copy / REPLICATED_TENSORS).read_bytes())
    data[-7] ^= 0x10
    (copy / REPLICATED_TENSORS).write_bytes(bytes(data))
    results = _run_ranks(2, ["train", *BASE, f"run.dir={tmp_path / 'run'}", f"resume={copy}"])
    _all_fail_with(results, "does not match the manifest (corrupted)")


def test_one_rank_failing_to_load_eval_weights_fails_all_ranks(trained: Path, tmp_path: Path) -> None:
    results = _run_ranks(3, ["eval", *BASE, "--weights", str(trained / "model.pt"), "--out", str(tmp_path / "out")],
                         inject=("hpctrain.evaluation.job:load_weights", 1))
    _all_fail_with(results, "injected failure in load_weights on rank 1")
    assert not (tmp_path / "out" / "eval.json").exists()


def test_eval_at_two_plain_ranks_writes_results(trained: Path, tmp_path: Path) -> None:
    """The same launch without a failure succeeds (the failure tests are not vacuous)."""
    results = _run_ranks(2, ["eval", *BASE, "--weights", str(trained / "model.pt"), "--out", str(tmp_path / "out"),
                             "--predictions"])
    assert [code for code, _ in results] == [0, 0], results[0][1][-2000:]
    rows = (tmp_path / "out" / "predictions.jsonl").read_text().splitlines()
    report = json.loads((tmp_path / "out" / "eval.json").read_text())
    assert report["world_size"] == 2 and len(rows) == report["count"] > 0
    assert sorted(json.loads(row)["key"] for row in rows) == list(range(report["count"]))  # each sample once
    assert not [p for p in (tmp_path / "out").iterdir() if p.name.startswith(".")]  # no temporary files left


def _copy_run(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_run_overwrite_rank0_prepares_the_run_dir_while_the_others_wait(trained: Path, tmp_path: Path) -> None:
    """run.overwrite=true renames checkpoints/ away on rank 0 only, after the process group
    exists: its failure reaches every rank, and without one every rank trains the new run."""
    run = _copy_run(trained, tmp_path / "run")
    args = ["train", *BASE, f"run.dir={run}", "run.overwrite=true", "resume=never"]
    failed = _run_ranks(2, args, inject=("hpctrain.core.rundir:_remove_old_checkpoints", 0))
    _all_fail_with(failed, "injected failure in _remove_old_checkpoints on rank 0")
    assert (run / "summary.json").is_file()  # untouched
    results = _run_ranks(2, args)
    assert [code for code, _ in results] == [0, 0], results[0][1][-2000:]
    assert json.loads((run / "summary.json").read_text())["world_size"] == 2
    manifests = [layout.read_manifest(p) for _, p in layout.committed(run / "checkpoints")]
    assert manifests and all(m["world_size"] == 2 for m in manifests)  # only the new run's checkpoints
