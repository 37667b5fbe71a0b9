"""Exact distributed evaluation: every sample once, single-process numbers at any world size."""

import math

import pytest
import torch

from hpctrain.core.env import ClusterEnv
from hpctrain.data.in_memory import EvalLoader, rank_slice_of
from hpctrain.data.synthetic import synthetic
from hpctrain.evaluation.evaluate import evaluate
from hpctrain.tasks.metrics import Accuracy, ConfusionMatrix, EvalOutput, MeanLoss, Metric, default_metrics
from tests.dist_utils import run_ranks
from tests.user_models import tiny_mlp

SIZE, BATCH = 1001, 64


def _eval(env: ClusterEnv, size: int = SIZE, batch: int = BATCH, predictions: bool = False) -> dict:
    torch.manual_seed(0)
    model = tiny_mlp(10)
    data = synthetic("val", size, (128,), seed=1)
    metrics = default_metrics(10) + [EvenCount()]
    result = evaluate(model, EvalLoader(data, env, batch), metrics, env, torch.device("cpu"),
                      collect_predictions=predictions)
    return {"metrics": result.metrics, "predictions": result.predictions}


class EvenCount(Metric):
    """A user metric through the protocol: share of samples whose target is even."""

    def reset(self) -> None:
        self.states = {"even": torch.tensor(0), "seen": torch.tensor(0)}

    def update(self, out: EvalOutput) -> None:
        self.states["even"] += int((out.targets % 2 == 0).sum())
        self.states["seen"] += out.targets.numel()

    def compute(self) -> dict:
        return {"even_share": int(self.states["even"]) / int(self.states["seen"])}


@pytest.fixture(scope="module")
def truth() -> dict:
    return _eval(ClusterEnv())["metrics"]


def test_single_process_counts_everything(truth):
    assert truth["count"] == SIZE
    assert sum(map(sum, truth["confusion_matrix"])) == SIZE


@pytest.mark.parametrize("world", [2, 3, 4])
def test_any_world_size_gives_the_single_process_numbers(world, truth):
    results = [r["metrics"] for r in run_ranks(world, _eval)]
    for got in results:  # every rank gets the global value
        assert got["count"] == SIZE
        assert got["correct"] == truth["correct"]
        assert got["confusion_matrix"] == truth["confusion_matrix"]
        assert got["top5_accuracy"] == truth["top5_accuracy"]
        assert got["even_share"] == truth["even_share"]
        assert math.isclose(got["loss"], truth["loss"], rel_tol=1e-6)
    assert all(r == results[0] for r in results)  # deterministic merge: identical on every rank


def test_rank_with_fewer_batches_does_not_hang():
    # 130 samples, batch 64, 2 ranks: 65 each -> 2 batches each; 3 ranks: 43/43/44 -> 1 batch each;
    # 129 on 2 ranks with batch 64: rank 0 has 64 (1 batch), rank 1 has 65 (2 batches).
    results = run_ranks(2, _eval, 129, 64, timeout=60)
    assert [r["metrics"]["count"] for r in results] == [129, 129]


def test_more_ranks_than_samples():
    results = run_ranks(3, _eval, 2, 64, timeout=60)
    assert all(r["metrics"]["count"] == 2 for r in results)


def test_predictions_gathered_to_rank_zero_with_keys():
    results = run_ranks(3, _eval, 100, 16, True)
    rows = results[0]["predictions"]
    assert sorted(r["key"] for r in rows) == list(range(100))
    assert results[1]["predictions"] == [] and results[2]["predictions"] == []
    assert sum(r["prediction"] == r["target"] for r in rows) == results[0]["metrics"]["correct"]


def test_split_has_no_repeats_and_no_gaps():
    for n in (0, 1, 7, 1001):
        for world in range(1, 5):
            parts = [list(rank_slice_of(n, r, world)) for r in range(world)]
            assert sorted(i for p in parts for i in p) == list(range(n))
            assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_metric_units():
    logits = torch.tensor([[2.0, 1.0, 0.0], [0.0, 2.0, 1.0], [0.0, 1.0, 2.0], [2.0, 0.0, 1.0]])
    targets = torch.tensor([0, 2, 2, 1])
    out = EvalOutput(logits, targets, torch.nn.functional.cross_entropy(logits, targets, reduction="none").double())
    acc, top2, loss, cm = Accuracy(1), Accuracy(2), MeanLoss(perplexity=True), ConfusionMatrix(3)
    for metric in (acc, top2, loss, cm):
        metric.update(out)
    assert acc.compute() == {"accuracy": 0.5, "correct": 2, "count": 4}
    assert top2.compute() == {"top2_accuracy": 0.75}
    assert math.isclose(loss.compute()["perplexity"], math.exp(loss.compute()["loss"]))
    assert cm.compute()["confusion_matrix"] == [[1, 0, 0], [1, 0, 0], [0, 1, 1]]
    assert cm.compute()["per_class_accuracy"][0] == 1.0


# ---------------------------------------------------------------- through the sharded loader


def _write_val_shards(root) -> None:
    """The same 1001 samples as the in-memory tests, as raw npy in 11 shards (the last one short)."""
    from hpctrain.data.pack import npy_bytes
    from hpctrain.data.writer import write_shards

    data = synthetic("val", SIZE, (128,), seed=1)
    samples = ((f"v{i:05d}", {"npy": npy_bytes(data.inputs[i].numpy()), "cls": str(int(data.targets[i])).encode()})
               for i in range(SIZE))
    meta = {"source": "test", "classes": [str(c) for c in range(10)], "decode": {"input": "npy", "target": "cls"}}
    write_shards(samples, root, "val", samples_per_shard=97, meta=meta)


def _eval_shards(env: ClusterEnv, root) -> dict:
    from hpctrain.data.loader import ShardedEvalLoader

    torch.manual_seed(0)
    model = tiny_mlp(10)
    loader = ShardedEvalLoader(root, env, BATCH, split="val")
    result = evaluate(model, loader, default_metrics(10), env, torch.device("cpu"), collect_predictions=True)
    return {"metrics": result.metrics, "keys": [r["key"] for r in result.predictions]}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_sharded_loader_gives_the_single_process_numbers(world, truth, tmp_path):
    _write_val_shards(tmp_path)
    results = run_ranks(world, _eval_shards, tmp_path)
    got = results[0]
    assert got["metrics"]["count"] == SIZE and got["metrics"]["correct"] == truth["correct"]
    assert got["metrics"]["confusion_matrix"] == truth["confusion_matrix"]
    assert math.isclose(got["metrics"]["loss"], truth["loss"], rel_tol=1e-6)
    assert sorted(got["keys"]) == [f"v{i:05d}" for i in range(SIZE)]  # every sample once, with its key
    assert all(r["metrics"] == got["metrics"] for r in results)
