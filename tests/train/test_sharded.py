"""Strategies through the trainer (gloo, CPU; the world-2 runs on one forked pair of ranks):
FSDP (ZeRO-3 and ZeRO-2), ZeRO-1
and a 2-stage pipeline at world 2 train the tiny GPT to the same losses
as one process (with gradient accumulation and clipping); an FSDP checkpoint (DCP) saved at
world 2 resumes at world 1 and 4 with the data position kept and the same next-step losses,
and bit-identically after a SIGKILL; a ZeRO-1 checkpoint resumes bit-identically. (DeepSpeed
ZeRO 1-3 through the trainer against one process: tests/train/test_deepspeed.py.)"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hpctrain.checkpoint import layout
from hpctrain.config import ConfigError, load_config
from hpctrain.core.env import ClusterEnv
from hpctrain.models.gpt import GPT, GPTShape
from hpctrain.parallel.deepspeed import DeepSpeedMissing
from hpctrain.planning.layout import make_layout
from hpctrain.train import train
from hpctrain.weights.digest import params_sha256
from tests.checkpoint import test_preempt as preempt
from tests.data.test_text import needs_sdist
from tests.dist_utils import train_cases
from tests.gpt_runs import assert_close, check_ok, step_losses

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [needs_sdist, pytest.mark.slow]
TOL = 1e-5
# 16 samples a step: 4 per micro-batch, so 4 micro-steps at world 1, 2 at world 2, 1 at world 4
BASE = ["model.name=gpt", "model.n_layers=2", "model.hidden=32", "model.heads=4", "model.seq_len=32",
        "data.name=shards", "data.batch_size=4", "data.global_batch_size=16", "data.max_val_samples=41",
        "data.eval_batch_size=4",  # 21 + 20 samples: 6 and 5 eval batches, so FSDP ranks must keep in step
        "train.max_steps=10", "train.log_every=1", "train.progress=false", "train.threads=1",
        "train.clip_grad_norm=0.5", "optim.name=adamw", "optim.lr=0.01", "optim.schedule=constant",
        "checkpoint.every_seconds=None"]


@pytest.fixture(scope="module")
def one_process(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("one") / "run"
    train(load_config(None, [*BASE, f"data.path={shards}", f"run.dir={run}", "checkpoint.enabled=false"]))
    return run


def _run(n: int, shards: Path, run: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "hpctrain", "run", "-n", str(n), "train", *BASE, f"data.path={shards}",
           f"run.dir={run}", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, cwd=ROOT)


NO_CKPT = "checkpoint.enabled=false"
UNTIED = "model.tie_weights=false"
LONGER = ["parallel.strategy=fsdp", "train.max_steps=24"]
STEP5 = Path("checkpoints") / "step-000000005"


def _world2_cases(root: Path) -> list[tuple[str, list[str]]]:
    """(name, keys) of every world-2 run of this module, in the order they run (a resume after
    the run it resumes from)."""
    cases = [("fsdp-zero3", ["parallel.strategy=fsdp", NO_CKPT]),
             ("fsdp-zero2", ["parallel.strategy=fsdp", "parallel.reshard_after_forward=false", NO_CKPT]),
             ("zero1", ["parallel.strategy=zero1", NO_CKPT]),
             ("fsdp-saved", ["parallel.strategy=fsdp", "checkpoint.every_steps=5"]),
             ("zero1-saved", ["parallel.strategy=zero1", "checkpoint.every_steps=5"]),
             ("zero1-at2", ["parallel.strategy=zero1", f"resume={root / 'zero1-saved' / STEP5}"]),
             ("fsdp-24", [*LONGER, NO_CKPT]),
             ("pp", [UNTIED, NO_CKPT, "parallel.pp=2", "parallel.microbatches=2"])]
    return cases


@pytest.fixture(scope="module")
def two_ranks(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every world-2 run of this module on one forked pair of ranks, in turn (the launcher is
    tested where it matters: the SIGKILL below, tests/launch, tests/train/test_e2e.py). Run NAME
    is ``root / NAME``."""
    root = tmp_path_factory.mktemp("two")
    cases = [(name, [*BASE, f"data.path={shards}", *keys]) for name, keys in _world2_cases(root)]
    ranks = train_cases(2, cases, root, keep=("steps",))
    failed = {name: got for name, got in ranks[0].items() if not isinstance(got, dict)}
    assert not failed, failed
    return root


@pytest.mark.parametrize("name", ["fsdp-zero3", "fsdp-zero2", "zero1"])
def test_two_ranks_match_one_process(one_process: Path, two_ranks: Path, name: str) -> None:
    run = two_ranks / name
    want = step_losses(one_process)
    assert len(want) == 10 and want[10] < want[1] - 1.0
    assert_close(step_losses(run), want)
    one, two = (json.loads((r / "summary.json").read_text()) for r in (one_process, run))
    assert two["world_size"] == 2 and two["val_count"] == one["val_count"] == 41
    assert abs(two["val_loss"] - one["val_loss"]) < TOL


def test_fsdp_checkpoint_resumes_at_world_1_and_4(shards: Path, two_ranks: Path, tmp_path: Path) -> None:
    saved = two_ranks / "fsdp-saved"
    ckpt = saved / STEP5
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["format"] == "dcp" and manifest["world_size"] == 2  # forced for a sharded strategy
    # model.pt is one consolidated file that a plain GPT loads; its hash is the summary's
    model = GPT(GPTShape(vocab=256, seq_len=32, n_layers=2, hidden=32, heads=4))
    model.load_state_dict(torch.load(saved / "model.pt", weights_only=True))
    summary = json.loads((saved / "summary.json").read_text())
    assert params_sha256(model) == summary["params_sha256"]
    want = {s: v for s, v in step_losses(saved).items() if s > 5}
    resume = ["parallel.strategy=fsdp", f"resume={ckpt}", "checkpoint.enabled=true"]
    at1 = tmp_path / "at1"
    train(load_config(None, [*BASE, f"data.path={shards}", f"run.dir={at1}", *resume]))
    at4 = tmp_path / "at4"
    got = train_cases(4, [("at4", [*BASE, f"data.path={shards}", *resume])], tmp_path)[0]["at4"]
    assert isinstance(got, dict), got
    for run in (at1, at4):
        assert_close(step_losses(run), want)  # the same batches (the data position kept) and the same weights


def test_fsdp_sigkill_then_restart_is_bit_identical(shards: Path, two_ranks: Path, tmp_path: Path) -> None:
    """SIGKILL to both FSDP ranks and the launcher mid-run (a DCP save may be in flight), then
    the same command: it resumes from the last committed checkpoint to the uninterrupted weights.
    Async saves: the writer stages each rank's DTensor shards (parameters while the next
    forward runs) and must capture the step's state exactly."""
    longer = LONGER
    reference = two_ranks / "fsdp-24"
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "hpctrain", "run", "-n", "2", "train", *BASE, f"data.path={shards}",
           f"run.dir={run_dir}", *longer, "checkpoint.every_steps=3", "checkpoint.mode=async"]
    kill_at = random.Random().randint(5, 18)
    proc = preempt._start(cmd)
    preempt._wait_for_step(run_dir, kill_at, proc)
    _wait_for_a_commit(run_dir / "checkpoints", proc)  # an async save may still be writing at kill_at
    for pid in [*preempt._workers(proc.pid), proc.pid]:
        os.kill(pid, signal.SIGKILL)  # nothing gets to clean up, as on a node failure
    proc.communicate()
    assert not (run_dir / "summary.json").exists()
    saved = [step for step, _ in layout.committed(run_dir / "checkpoints")]
    assert saved and saved[-1] < 24, saved
    again = _run(2, shards, run_dir, *longer, "checkpoint.every_steps=3", "checkpoint.mode=async")
    check_ok(again)
    assert f"resumed from {run_dir / 'checkpoints' / layout.step_name(saved[-1])}" in again.stderr + again.stdout
    summaries = [json.loads((r / "summary.json").read_text()) for r in (reference, run_dir)]
    assert summaries[1]["params_sha256"] == summaries[0]["params_sha256"], (kill_at, saved)


def _wait_for_a_commit(root: Path, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + preempt.TIMEOUT
    while not layout.committed(root):
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"no committed checkpoint under {root} before the run ended")
        time.sleep(0.01)


def test_zero1_checkpoint_resumes_at_world_2_and_1(shards: Path, two_ranks: Path, tmp_path: Path) -> None:
    """ZeRO-1 at world 2 checkpoints the optimizer state consolidated on rank 0 (format=torch);
    a resume at world 2 (re-split) continues bit-identically, one at world 1 (whole) within 1e-6."""
    saved = two_ranks / "zero1-saved"
    ckpt = saved / STEP5
    assert json.loads((ckpt / "manifest.json").read_text())["format"] == "torch"
    want = {s: v for s, v in step_losses(saved).items() if s > 5}
    at2 = two_ranks / "zero1-at2"
    assert step_losses(at2) == want
    summaries = [json.loads((r / "summary.json").read_text()) for r in (saved, at2)]
    assert summaries[0]["params_sha256"] == summaries[1]["params_sha256"]
    at1 = tmp_path / "at1"
    train(load_config(None, [*BASE, f"data.path={shards}", f"run.dir={at1}", f"resume={ckpt}"]))
    got = step_losses(at1)
    assert got.keys() == want.keys() and max(abs(got[s] - want[s]) for s in want) < 1e-6


def test_pipeline_two_stages_match_one_process(shards: Path, two_ranks: Path, tmp_path: Path) -> None:
    """pp=2 through the loop's step function (1F1B, 2 micro-batches of each of the 4 micro-steps
    per optimizer step, global clipping over both stages) trains as one process does; model.pt
    holds the whole model, gathered from the stages."""
    one = tmp_path / "one"
    train(load_config(None, [*BASE, f"data.path={shards}", f"run.dir={one}", UNTIED, NO_CKPT]))
    run = two_ranks / "pp"
    want = step_losses(one)
    assert len(want) == 10 and want[10] < want[1] - 1.0
    assert_close(step_losses(run), want)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["val_count"] == 41  # validated through the stages
    assert summary["samples_seen"] == json.loads((one / "summary.json").read_text())["samples_seen"] == 160
    model = GPT(GPTShape(vocab=256, seq_len=32, n_layers=2, hidden=32, heads=4, tie_weights=False))
    model.load_state_dict(torch.load(run / "model.pt", weights_only=True))
    assert params_sha256(model) == summary["params_sha256"]
    # the same weights up to float32 summation order (micro-batches of 2 rows, not 4), which 10
    # AdamW steps of lr 0.01 grow to ~2e-5 on a few entries
    mine = dict(model.named_parameters())
    for name, value in torch.load(one / "model.pt", weights_only=True).items():
        worst = (mine[name] - value).abs().max().item()
        assert worst < 1e-4, (name, worst)


def test_strategies_not_in_the_loop_fail_before_start(shards: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Checked by train() before the process group on every rank (ranks exit 2 alike; which
    exit code `hpctrain run` shows when ranks stop at different times is the launcher's)."""
    two = ClusterEnv(world_size=2, local_world_size=2)
    tied = load_config(None, [*BASE, "parallel.pp=2", "checkpoint.enabled=false"])
    with pytest.raises(ConfigError, match="hint: model.tie_weights=false"):
        make_layout(tied, two)
    untied = load_config(None, [*BASE, "parallel.pp=2", "model.tie_weights=false"])
    with pytest.raises(ConfigError, match=r"strategy=ddp with dp=2 x tp=1 x pp=2 is not supported"):
        make_layout(untied, ClusterEnv(world_size=4, local_world_size=4))
    deepspeed = load_config(None, [*BASE, "parallel.strategy=deepspeed"])
    make_layout(deepspeed, two)  # checkpoints and lr schedules run under DeepSpeed now (tests/train/test_deepspeed.py)
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # as if not installed: a UserError with the install hint
    with pytest.raises(DeepSpeedMissing, match=r"hint: pip install .*hpctrain\[deepspeed\]"):
        make_layout(deepspeed, two)
    tensor = load_config(None, [*BASE, "model.name=resnet18", "parallel.strategy=fsdp", "parallel.tp=2"])
    with pytest.raises(ConfigError, match="parallel.tp=2 cannot split model.name=resnet18"):
        make_layout(tensor, two)  # tp runs in the loop now (tests/train/test_tp.py), on the gpt's blocks
    zero1 = load_config(None, [*BASE, "parallel.strategy=zero1", "checkpoint.format=dcp"])
    with pytest.raises(ConfigError, match="hint: checkpoint.format=torch"):
        make_layout(zero1, two)
    make_layout(zero1, ClusterEnv())  # one process: nothing to split
    proc = _run(2, shards, tmp_path / "z", "parallel.strategy=zero1", "checkpoint.format=dcp")
    assert proc.returncode != 0 and "zero1 checkpoints with checkpoint.format=torch" in proc.stderr
    assert not (tmp_path / "z").exists()  # failed before anything was written
