"""Pipeline parallelism through the trainer (gloo, CPU, the tiny untied GPT; forked ranks): pp2 x dp2
(FSDP per stage over dp) trains as one process does; validation through the stages counts
every sample once and gives one process's val_loss; DCP checkpoints under the whole model's
names resume bit-identically at pp2, at pp2 x dp2 and in one process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hpctrain.config import ConfigError, load_config
from hpctrain.core.env import ClusterEnv
from hpctrain.models.gpt import GPT, GPTShape
from hpctrain.planning.layout import make_layout
from hpctrain.train import train
from hpctrain.weights.digest import params_sha256
from tests.data.test_text import needs_sdist
from tests.dist_utils import run_ranks, train_cases
from tests.gpt_runs import assert_close, read_summary, step_losses
from tests.sharding_models import MODELS, lm_loss, token_batches
from tests.train.test_sharded import BASE

pytestmark = [needs_sdist, pytest.mark.slow]
TOL = 1e-5
# untied (the stages cannot share the embedding); validate at the end of every run
PP = ["model.tie_weights=false", "parallel.microbatches=2"]
SHAPE = GPTShape(vocab=256, seq_len=32, n_layers=2, hidden=32, heads=4, tie_weights=False)


@pytest.fixture(scope="module")
def one_process(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("one") / "run"
    train(load_config(None, [*BASE, *PP, f"data.path={shards}", f"run.dir={run}", "checkpoint.enabled=false",
                             "train.max_steps=4"]))
    return run


COMMON = [*PP, "parallel.pp=2", "checkpoint.every_steps=2", "train.max_steps=4"]
STEP2 = Path("checkpoints") / "step-000000002"
PPTP = [*PP, "parallel.pp=2", "parallel.tp=2", "train.max_steps=4"]
FP16 = [*PP, "precision=fp16", "checkpoint.enabled=false", "train.max_steps=4"]


def _cases(shards: Path, cases: list[tuple[str, list[str]]]) -> list[tuple[str, list[str]]]:
    return [(name, [*BASE, f"data.path={shards}", *keys]) for name, keys in cases]


def _all_ok(ranks: list[dict]) -> None:
    failed = {name: got for name, got in ranks[0].items() if not isinstance(got, dict)}
    assert not failed, failed


@pytest.fixture(scope="module")
def two_ranks(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The world-2 runs on one forked pair of ranks, in turn; run NAME is ``root / NAME``."""
    root = tmp_path_factory.mktemp("pp2")
    _all_ok(train_cases(2, _cases(shards, [
        ("interleaved", [*PP, "model.n_layers=4", "parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b",
                         "checkpoint.enabled=false", "train.max_steps=4", "train.eval_every_steps=2",
                         "data.eval_batch_size=3"]),
        ("whole", COMMON),
        ("rest", [*COMMON, f"resume={root / 'whole' / STEP2}"]),
        ("fp16", [*FP16, "parallel.pp=2"])]), root, keep=("steps",)))
    return root


@pytest.fixture(scope="module")
def four_ranks(shards: Path, two_ranks: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The world-4 runs on one forked set of 4 ranks, in turn."""
    root = tmp_path_factory.mktemp("pp4")
    _all_ok(train_cases(4, _cases(shards, [
        ("pp2dp2", [*PP, "parallel.pp=2", "parallel.strategy=fsdp", "checkpoint.enabled=false",
                    "train.max_steps=4", "train.eval_every_steps=2"]),
        ("pp2tp2", [*PPTP, "checkpoint.every_steps=2"]),
        ("pp2tp2-resumed", [*PPTP, f"resume={root / 'pp2tp2' / STEP2}"]),
        ("at4", [*COMMON, "parallel.strategy=fsdp", f"resume={two_ranks / 'whole' / STEP2}"])]), root,
        keep=("steps",)))
    return root


def _val_rows(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if "val_loss" in row]


def test_pp2_x_dp2_matches_one_process(one_process: Path, four_ranks: Path) -> None:
    """World 4 = pp2 x dp2 (FSDP per stage over dp, 1F1B): the dp replicas read different halves
    of the global batch; the logged loss is the global batch's; validation every 2 steps (41
    samples, 21 + 20 on the two replicas, padded to the micro-batches) counts each sample once
    and is logged once (by rank 0, the first stage); model.pt is the whole model."""
    run = four_ranks / "pp2dp2"
    want = step_losses(one_process)
    assert len(want) == 4 and want[4] < want[1]
    assert_close(step_losses(run), want)
    one, four = read_summary(one_process), read_summary(run)
    assert four["world_size"] == 4 and four["samples_seen"] == one["samples_seen"] == 64
    assert four["val_count"] == one["val_count"] == 41 and four["val_tokens"] == one["val_tokens"]
    assert abs(four["val_loss"] - one["val_loss"]) < TOL
    rows = _val_rows(run)  # validation mid-run too: the schedule goes from eval back to training unharmed
    assert [row["step"] for row in rows] == [2, 4] and all(row["val_count"] == 41 for row in rows)
    model = GPT(SHAPE)
    model.load_state_dict(torch.load(run / "model.pt", weights_only=True))
    assert params_sha256(model) == four["params_sha256"]


def test_pp2_x_tp2_matches_one_process(one_process: Path, four_ranks: Path) -> None:
    """World 4 = pp2 x tp2: tensor parallel inside each stage; both tp ranks of a stage read the
    same batches, validation counts the last stage's outputs once (not tp times), model.pt is
    gathered from the DTensor shards of every stage, and a checkpoint resumes bit for bit."""
    run = four_ranks / "pp2tp2"
    assert_close(step_losses(run), step_losses(one_process))
    resumed = four_ranks / "pp2tp2-resumed"  # DCP with DTensor shards under the whole model's names: bit for bit
    assert sorted(step_losses(resumed)) == [3, 4]
    assert read_summary(resumed)["params_sha256"] == read_summary(run)["params_sha256"]
    one, four = read_summary(one_process), read_summary(run)
    assert four["samples_seen"] == one["samples_seen"] == 64
    assert four["val_count"] == one["val_count"] == 41 and abs(four["val_loss"] - one["val_loss"]) < TOL
    model = GPT(SHAPE)
    model.load_state_dict(torch.load(run / "model.pt", weights_only=True))
    assert params_sha256(model) == four["params_sha256"]
    reference = GPT(SHAPE)
    reference.load_state_dict(torch.load(one_process / "model.pt", weights_only=True))
    for name, value in reference.state_dict().items():
        assert (model.state_dict()[name] - value).abs().max() < 1e-4, name  # summation order only


def test_pp2_interleaved_validation_counts_every_sample_once(two_ranks: Path) -> None:
    """Interleaved 1F1B (two stages per rank, 4 blocks): validation every 2 steps through the
    stages, eval batches of 3 padded to the 2 micro-batches, counts all 41 samples once."""
    run = two_ranks / "interleaved"
    rows = _val_rows(run)
    assert [row["step"] for row in rows] == [2, 4] and all(row["val_count"] == 41 for row in rows)
    assert read_summary(run)["val_loss"] == rows[-1]["val_loss"] < rows[0]["val_loss"]


def test_pp2_checkpoint_resumes_bitwise_at_dp2_and_in_one_process(shards: Path, two_ranks: Path, four_ranks: Path,
                                                                   tmp_path: Path) -> None:
    """pp2 checkpoints every 2 steps (DCP, whole-model names): the step-2 checkpoint resumed at
    pp2 to step 4 ends with the uninterrupted run's losses and weights bit for bit; resumed at
    pp2 x dp2 (world 4, FSDP stages) and by one process it gives the same next losses (1e-5)."""
    whole = two_ranks / "whole"
    ckpt = whole / STEP2
    assert json.loads((ckpt / "manifest.json").read_text())["format"] == "dcp"
    rest = two_ranks / "rest"
    assert read_summary(rest)["params_sha256"] == read_summary(whole)["params_sha256"]
    assert step_losses(rest) == {s: v for s, v in step_losses(whole).items() if s > 2}
    want = {s: v for s, v in step_losses(whole).items() if s > 2}
    assert_close(step_losses(four_ranks / "at4"), want)
    one = tmp_path / "one"
    train(load_config(None, [*BASE, *PP, f"data.path={shards}", f"run.dir={one}", f"resume={ckpt}",
                             "train.max_steps=4", "checkpoint.every_steps=2"]))
    assert_close(step_losses(one), want)


def test_pipeline_limits_fail_before_start() -> None:
    """What pp still refuses names its numbers and a hint; pp2 x dp2 needs a sharded strategy."""
    two, four = ClusterEnv(world_size=2, local_world_size=2), ClusterEnv(world_size=4, local_world_size=4)
    ok = load_config(None, [*BASE, *PP, "parallel.pp=2", "parallel.strategy=fsdp", "train.eval_every_steps=5"])
    make_layout(ok, four)  # checkpoints, validation, dp x pp: all run
    with pytest.raises(ConfigError, match=r"strategy=ddp with dp=2 x tp=1 x pp=2 is not supported"):
        make_layout(load_config(None, [*BASE, *PP, "parallel.pp=2"]), four)
    with pytest.raises(ConfigError, match=r"= 2 != world size 3"):
        make_layout(load_config(None, [*BASE, *PP, "parallel.pp=2", "parallel.dp=1"]),
                       ClusterEnv(world_size=3, local_world_size=3))
    make_layout(load_config(None, [*BASE, *PP, "parallel.pp=2", "precision=fp16"]), two)
    make_layout(load_config(None, [*BASE, *PP, "parallel.pp=2", "parallel.tp=2"]), four)  # tp inside stages
    with pytest.raises(ConfigError, match="hint: model.tie_weights=false"):
        make_layout(load_config(None, [*BASE, "parallel.pp=2", "parallel.strategy=fsdp"]), four)


def test_pp2_fp16_matches_one_process_fp16(shards: Path, two_ranks: Path, tmp_path: Path) -> None:
    """precision=fp16 under pp2: the last stage scales the loss inside the schedule, every
    stage unscales its gradients; the losses follow one process's fp16 run (fp16 rounding)."""
    one = tmp_path / "one"
    train(load_config(None, [*BASE, *FP16, f"data.path={shards}", f"run.dir={one}"]))
    run = two_ranks / "fp16"
    got, want = step_losses(run), step_losses(one)
    assert got.keys() == want.keys() and max(abs(got[s] - want[s]) for s in want) < 2e-4
    assert abs(read_summary(run)["val_loss"] - read_summary(one)["val_loss"]) < 2e-4


def _overflow_on_stage_0(env: ClusterEnv) -> dict:
    """One pp2 step with fp16 loss scaling whose stage 0 alone gets an inf gradient."""
    from hpctrain.config.parallel import ParallelConfig
    from hpctrain.parallel import build_pipeline_step
    from hpctrain.parallel.fsdp import sharded_grad_scaler

    torch.manual_seed(0)
    step = build_pipeline_step(MODELS["toy"](2), env, ParallelConfig(pp=2, microbatches=2, pp_schedule="gpipe"),
                               device=torch.device("cpu"), loss_fn=lm_loss)
    step.grad_scaler = scaler = sharded_grad_scaler(torch.device("cpu"))
    optimizer = torch.optim.SGD(step.parameters(), lr=0.1)
    inputs, targets = next(iter(token_batches(1, 4)))
    loss = step(inputs, targets)
    if env.rank == 0:
        next(p for p in step.parameters() if p.grad is not None).grad[0] = float("inf")
    before = [p.detach().clone() for p in step.parameters()]
    scaler.step(optimizer)
    scaler.update()
    return {"loss": float(loss), "scale": scaler.get_scale(),
            "unchanged": all(torch.equal(a, p) for a, p in zip(before, step.parameters()))}


def test_pp2_fp16_overflow_on_one_stage_skips_the_step_on_every_stage() -> None:
    ranks = run_ranks(2, _overflow_on_stage_0)
    assert all(r["unchanged"] for r in ranks)  # stage 1's gradients were finite, yet it skipped too
    assert ranks[0]["scale"] == ranks[1]["scale"] == 65536.0 / 2  # both halved the scale
    assert ranks[0]["loss"] == ranks[1]["loss"] > 0  # the true (unscaled) loss on both stages
