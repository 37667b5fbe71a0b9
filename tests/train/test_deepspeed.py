"""strategy=deepspeed in `hpctrain train` (DeepSpeed on CPU with gloo, 2 ranks): the lr schedule
(warmup + cosine) is handed to the engine and matches a one-process DDP run step by step, with
the same losses; DeepSpeed's own checkpoint files are committed inside hpctrain's protocol
(manifest, verify), resume to the uninterrupted run's weights, survive a SIGTERM (exit 3, then
the same command completes), consolidate with zero_to_fp32, and refuse another world size or
strategy before training, with both world sizes and a hint in the message."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hpctrain.checkpoint import layout
from hpctrain.config import load_config
from hpctrain.core.errors import EXIT_PREEMPTED
from hpctrain.models.gpt import GPT, GPTShape
from hpctrain.train import train
from hpctrain.weights.digest import params_sha256
from tests.checkpoint import test_preempt as preempt
from tests.data.test_text import needs_sdist
from tests.dist_utils import train_cases
from tests.gpt_runs import check_ok

ROOT = Path(__file__).resolve().parents[2]
# find_spec, not importorskip: importing DeepSpeed here would pick its accelerator in the test process
pytestmark = [needs_sdist, pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                              reason="the deepspeed extra is not installed")]
TOL = 1e-5
STEPS = 12
STEP4 = Path("checkpoints") / "step-000000004"
# 16 samples a step: 4 per micro-batch, 4 micro-steps at world 1, 2 at world 2; lr: 3 warmup steps, then cosine
BASE = ["model.name=gpt", "model.n_layers=2", "model.hidden=32", "model.heads=4", "model.seq_len=32",
        "data.name=shards", "data.batch_size=4", "data.global_batch_size=16", "data.max_val_samples=41",
        "data.eval_batch_size=4", f"train.max_steps={STEPS}", "train.log_every=1", "train.progress=false",
        "train.threads=1", "train.clip_grad_norm=0.5", "optim.name=adamw", "optim.lr=0.01",
        "optim.schedule=cosine", "optim.warmup_steps=3", "checkpoint.every_seconds=None"]


def _ds(stage: int) -> list[str]:
    return ["parallel.strategy=deepspeed", f"parallel.deepspeed_stage={stage}"]


@pytest.fixture(scope="module")
def shards(shakespeare_shards: Path) -> Path:
    return shakespeare_shards


def _cmd(n: int, shards: Path, run: Path, *extra: str) -> list[str]:
    launch = ["run", "-n", str(n), "train"] if n > 1 else ["train"]
    return [sys.executable, "-m", "hpctrain", *launch, *BASE, f"data.path={shards}", f"run.dir={run}", *extra]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _run(n: int, shards: Path, run: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(_cmd(n, shards, run, *extra), capture_output=True, text=True, timeout=300, env=_env(),
                          cwd=ROOT)


def _rows(run: Path) -> dict[int, dict[str, float]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row for row in rows if "loss" in row}


def _sha(run: Path) -> str:
    return str(json.loads((run / "summary.json").read_text())["params_sha256"])


def _train_one(shards: Path, run: Path, *extra: str) -> Path:
    """A one-process run (strategy=ddp, no DeepSpeed) in this process: the reference."""
    train(load_config(None, [*BASE, f"data.path={shards}", f"run.dir={run}", *extra]))
    return run


@pytest.fixture(scope="module")
def one_process(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _train_one(shards, tmp_path_factory.mktemp("one") / "run", "checkpoint.enabled=false")


SGD = ["optim.name=sgd", "optim.momentum=0.9", "optim.lr=0.05", "train.max_steps=4", "checkpoint.enabled=false"]


@pytest.fixture(scope="module")
def two_ranks(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every world-2 run of this module on one forked pair of ranks, in turn: the uninterrupted
    12-step run of each ZeRO stage, checkpointing every 4 steps, two-tier (DeepSpeed's nested
    files copied from the node-local tier), async asked for (DeepSpeed's save runs in the loop
    all the same); the resumes from their step 4; SGD under ZeRO-3. Returns the root: run NAME
    is ``root / NAME``."""
    root = tmp_path_factory.mktemp("two")
    data = [*BASE, f"data.path={shards}"]
    cases = [(f"zero{stage}", [*data, *_ds(stage), "checkpoint.every_steps=4", "checkpoint.mode=async",
                                f"checkpoint.local_dir={root}/local{stage}"]) for stage in (1, 2, 3)]
    cases += [(f"resumed{stage}", [*data, *_ds(stage), f"resume={root / f'zero{stage}' / STEP4}"])
              for stage in (2, 3)]
    cases.append(("sgd", [*data, *_ds(3), *SGD]))
    ranks = train_cases(2, cases, root, keep=("steps",))
    failed = {name: got for name, got in ranks[0].items() if not isinstance(got, dict)}
    assert not failed, failed
    return root


def saved(root: Path, stage: int) -> Path:
    return root / f"zero{stage}"


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_lr_schedule_and_losses_match_one_process(one_process: Path, two_ranks: Path, stage: int) -> None:
    """The engine steps hpctrain's scheduler once per accumulation window (2 micro-steps here):
    the logged lr equals the one-process DDP run's at every step, and so do the losses (1e-5), the
    exact validation and the samples seen; model.pt is the whole model."""
    want, got = _rows(one_process), _rows(saved(two_ranks, stage))
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    lrs = [want[s]["lr"] for s in range(1, STEPS + 1)]
    assert lrs[0] < lrs[2] == pytest.approx(0.01) and lrs[-1] < lrs[3]  # warmup, then the cosine decay
    assert [got[s]["lr"] for s in range(1, STEPS + 1)] == lrs
    worst = max(abs(got[s]["loss"] - want[s]["loss"]) for s in want)
    assert worst < TOL, worst
    assert want[STEPS]["loss"] < want[1]["loss"] - 1.0
    # model.pt is the whole model (ZeRO-3: gathered by DeepSpeed), hashed as the summary says; the
    # validation counts every sample once, as one process does
    run = saved(two_ranks, stage)
    model = GPT(GPTShape(vocab=256, seq_len=32, n_layers=2, hidden=32, heads=4))
    model.load_state_dict(torch.load(run / "model.pt", weights_only=True))
    one, two = (json.loads((r / "summary.json").read_text()) for r in (one_process, run))
    assert params_sha256(model) == two["params_sha256"]
    assert two["world_size"] == 2 and two["val_count"] == one["val_count"] == 41
    assert abs(two["val_loss"] - one["val_loss"]) < TOL and two["samples_seen"] == one["samples_seen"] == 16 * STEPS


def test_sgd_under_zero3_matches_one_process(shards: Path, two_ranks: Path, tmp_path: Path) -> None:
    """hpctrain hands its own torch optimizer to ZeRO; SGD with momentum (the default optimizer,
    which DeepSpeed calls untested) under ZeRO-3 gives the one-process losses."""
    want, got = _rows(_train_one(shards, tmp_path / "one", *SGD)), _rows(two_ranks / "sgd")
    assert sorted(got) == sorted(want) == [1, 2, 3, 4]
    assert max(abs(got[s]["loss"] - want[s]["loss"]) for s in want) < TOL


@pytest.mark.parametrize("stage", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_checkpoint_resumes_to_the_uninterrupted_run(two_ranks: Path, stage: int) -> None:
    """Stopped at step 4 (its committed checkpoint) and resumed to 12 == the uninterrupted 12 steps:
    the same losses and the same final weights (params_sha256)."""
    reference = saved(two_ranks, stage)
    manifest = layout.read_manifest(reference / STEP4)
    assert manifest["format"] == "deepspeed" and manifest["world_size"] == 2
    names = set(manifest["files"])  # every rank's ZeRO partition is in the manifest, with size and sha256
    assert {f"deepspeed/state/zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)} <= names
    assert {"rank-00000.pt", "rank-00001.pt", "replicated.pt"} <= names  # hpctrain's RNG, loader, counters
    run = two_ranks / f"resumed{stage}"
    want, got = _rows(reference), _rows(run)
    assert sorted(got) == list(range(5, STEPS + 1))  # it went on from step 4
    assert max(abs(got[s]["loss"] - want[s]["loss"]) for s in got) < TOL
    assert [got[s]["lr"] for s in got] == [want[s]["lr"] for s in got]
    assert _sha(run) == _sha(reference)


def test_verify_and_consolidate_a_deepspeed_checkpoint(two_ranks: Path, tmp_path: Path) -> None:
    """`hpctrain ckpt verify` checks DeepSpeed's files too; zero_to_fp32 (consolidated_state) merges
    the ZeRO-2 partitions into the final model.pt's weights."""
    run = saved(two_ranks, 2)
    verify = subprocess.run([sys.executable, "-m", "hpctrain", "ckpt", "verify", str(run)], capture_output=True,
                            text=True, env=_env(), cwd=ROOT, timeout=120)
    assert verify.returncode == 0 and verify.stdout.count(": ok") == 3, verify.stdout + verify.stderr
    last = run / "checkpoints" / layout.step_name(STEPS)
    merged = tmp_path / "merged.pt"
    code = ("import sys, torch; from pathlib import Path; from hpctrain.parallel.deepspeed import consolidated_state; "
            "torch.save(consolidated_state(Path(sys.argv[1])), sys.argv[2])")  # DeepSpeed imported out of process
    subprocess.run([sys.executable, "-c", code, str(last / "deepspeed"), str(merged)], check=True, env=_env(),
                   cwd=ROOT, timeout=120, capture_output=True)
    state = torch.load(merged, weights_only=True)
    model = torch.load(run / "model.pt", weights_only=True)
    assert state.keys() == model.keys()
    assert all(torch.equal(state[k], model[k]) for k in model)
    broken = tmp_path / "broken"
    subprocess.run(["cp", "-r", str(last), str(broken)], check=True)
    part = broken / "deepspeed" / "state" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF
    part.write_bytes(bytes(data))
    verify = subprocess.run([sys.executable, "-m", "hpctrain", "ckpt", "verify", str(broken)], capture_output=True,
                            text=True, env=_env(), cwd=ROOT, timeout=120)
    assert verify.returncode == 1 and "zero_pp_rank_1_mp_rank_00_optim_states.pt: checksum" in verify.stdout


def test_other_world_size_or_strategy_fails_before_training(shards: Path, two_ranks: Path, tmp_path: Path) -> None:
    """A ZeRO checkpoint of world 2 resumed at world 1, or under strategy=ddp: exit 2 naming the
    checkpoint, both world sizes (or the format) and a hint; nothing is left in the run dir."""
    ckpt = saved(two_ranks, 2) / STEP4
    proc = _run(1, shards, tmp_path / "one", *_ds(2), f"resume={ckpt}")
    assert proc.returncode == 2, proc.stderr[-4000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert f"checkpoint {ckpt} holds DeepSpeed ZeRO state partitioned over 2 ranks" in line
    assert "cannot resume at world size 1; hint: resume with `hpctrain run -n 2`" in line
    proc = _run(1, shards, tmp_path / "ddp", f"resume={ckpt}")
    assert proc.returncode == 2, proc.stderr[-4000:]
    assert "has format=deepspeed and cannot resume under parallel.strategy=ddp" in proc.stderr
    assert not (tmp_path / "one").exists() and not (tmp_path / "ddp").exists()


def test_sigterm_saves_exits_3_and_the_same_command_completes(shards: Path, two_ranks: Path, tmp_path: Path) -> None:
    """SIGTERM to the launcher mid-run: the ranks agree, DeepSpeed's state is committed, exit 3;
    the same command resumes from it (resume=auto) to the uninterrupted run's weights."""
    run = tmp_path / "run"
    cmd = _cmd(2, shards, run, *_ds(2), "checkpoint.every_steps=100")  # only the signal saves mid-run
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    seen = preempt._wait_for_step(run, 2, proc)
    os.kill(proc.pid, signal.SIGTERM)
    code, out = preempt._finish(proc)
    assert code == EXIT_PREEMPTED, out[-4000:]
    steps = [s for s, _ in layout.committed(run / "checkpoints")]
    assert len(steps) == 1 and seen <= steps[0] < STEPS, (seen, steps)
    assert layout.read_manifest(run / "checkpoints" / layout.step_name(steps[0]))["format"] == "deepspeed"
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env(), cwd=ROOT)
    check_ok(again)
    assert f"resumed from {run / 'checkpoints' / layout.step_name(steps[0])}" in again.stderr
    assert _sha(run) == _sha(saved(two_ranks, 2))
