"""Regression: float targets (a scalar or a vector per row) from a CSV train an MLP with MSE at 1
and 2 ranks, and the validation MSE/MAE are exact over ranks (equal to one process's computation
from model.pt); a float target with only train.loss set trains (task custom); the public loaders
and evaluate() take float targets; a user metric by import path is merged exactly."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import TensorDataset

from hpctrain.core.env import ClusterEnv
from hpctrain.core.errors import UserError
from hpctrain.data.in_memory import EvalLoader, MemoryLoader
from hpctrain.evaluation.evaluate import evaluate, evaluate_dataset
from hpctrain.tasks import Regression
from hpctrain.tasks.metrics import EvalOutput, Metric, user_metrics
from tests.dist_utils import run_ranks, train_cases

pytest.importorskip("pyarrow")
CPU = torch.device("cpu")
FEATURES = 3


def mlp(num_classes: int = 1) -> torch.nn.Module:
    """``myreg``: FEATURES -> 8 -> num_classes (the values per sample the data has)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 8), torch.nn.Tanh(), torch.nn.Linear(8, num_classes))


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A user's own loss (train.loss=...:mse): the targets reach it as the table has them."""
    return torch.nn.functional.mse_loss(output.reshape(target.shape), target)


class MaxScaledError(Metric):
    """A user metric: the mean absolute error divided by 10, from a sum and a count (exact over ranks)."""

    def reset(self) -> None:
        self.states = {"sum": torch.zeros((), dtype=torch.float64), "n": torch.zeros((), dtype=torch.int64)}

    def update(self, out: EvalOutput) -> None:
        self.states["sum"] += (out.logits.double() - out.targets.double()).abs().sum() / 10
        self.states["n"] += out.targets.numel()

    def compute(self) -> dict[str, Any]:
        n = int(self.states["n"])
        return {"scaled_mae": float(self.states["sum"]) / n if n else math.nan}


def _features(i: int) -> list[float]:
    return [math.sin(i), math.cos(0.5 * i), (i % 7) / 7]


def _write_csv(path: Path, rows: range) -> None:
    lines = ["a,b,c,y1,y2"]
    for i in rows:
        a, b, c = _features(i)
        lines.append(f"{a},{b},{c},{2 * a - b + 0.25},{a * c}")
    path.write_text("\n".join(lines) + "\n")


def _table(tmp_path: Path) -> Path:
    root = tmp_path / "reg"
    root.mkdir()
    _write_csv(root / "train.csv", range(48))
    _write_csv(root / "val.csv", range(100, 123))  # 23 rows: uneven over 2 ranks and batches
    return root


def _by_hand(weights: Path, root: Path, outputs: int) -> tuple[float, float]:
    """MSE and MAE of model.pt over the validation rows, in one process, float64."""
    model = mlp(outputs)
    model.load_state_dict(torch.load(weights, weights_only=True))
    rows = range(100, 123)
    x = torch.tensor([_features(i) for i in rows])
    y = torch.tensor([[2 * a - b + 0.25, a * c] for a, b, c in map(_features, rows)], dtype=torch.float32)
    with torch.no_grad():
        pred = model(x)
    y = y[:, :outputs].reshape(pred.shape)
    err = pred.double() - y.double()
    return float(err.square().mean()), float(err.abs().mean())


def _keys(root: Path, *extra: str) -> list[str]:
    return [f"data.name=csv:{root}", "data.input_columns=[a,b,c]", "data.batch_size=4", "data.eval_batch_size=5",
            "train.epochs=2", "optim.lr=0.05", "train.progress=false", "checkpoint.enabled=false", *extra]


def _val_rows(run: Path) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "val_loss" in r]


@pytest.mark.parametrize("world", [1, 2])
def test_a_regression_csv_trains_and_validates_exactly_over_ranks(tmp_path: Path, world: int) -> None:
    root = _table(tmp_path)
    vector = ("vector", _keys(root, "train.task=regression", "data.label_columns=[y1,y2]",
                              "model.name=tests.tasks.test_regression:mlp",
                              "train.metrics=tests.tasks.test_regression:MaxScaledError"))
    scalar = ("scalar", _keys(root, "data.label_column=y1", "train.loss=tests.tasks.test_regression:mse",
                              "model.name=tests.tasks.test_regression:mlp"))
    summaries = train_cases(world, [vector, scalar], tmp_path / "runs", keep=("val_loss", "val_count", "task"))
    for case, outputs in (("vector", 2), ("scalar", 1)):
        got = summaries[0][case]
        assert isinstance(got, dict), got  # else the error the case ended with
        run = tmp_path / "runs" / case
        mse_hand, mae_hand = _by_hand(run / "model.pt", root, outputs)
        assert got["val_count"] == 23
        assert math.isclose(got["val_loss"], mse_hand, rel_tol=1e-6), (got, mse_hand)
        last = _val_rows(run)[-1]
        if case == "vector":
            assert got["task"] == "regression"
            assert math.isclose(last["val_mae"], mae_hand, rel_tol=1e-6)
            assert math.isclose(last["val_rmse"], math.sqrt(mse_hand), rel_tol=1e-6)
            assert math.isclose(last["val_scaled_mae"], mae_hand / 10, rel_tol=1e-6)  # the user metric, merged
        else:  # train.loss on float targets, no task named: the user's loss validates (task custom)
            assert got["task"] == "custom"
    if world == 1:  # hpctrain eval of model.pt: the same MSE, and predictions are the values
        from hpctrain.cli import main

        assert main(["eval", "--weights", str(tmp_path / "runs" / "vector" / "model.pt"), "--predictions",
                     *vector[1]]) == 0
        report = json.loads((tmp_path / "runs" / "vector" / "eval.json").read_text())
        assert report["loss"] == summaries[0]["vector"]["val_loss"] and report["task"] == "regression"
        rows = (tmp_path / "runs" / "vector" / "predictions.jsonl").read_text().splitlines()
        first = json.loads(rows[0])
        assert len(rows) == 23 and len(first["prediction"]) == 2 and len(first["target"]) == 2


def test_float_targets_are_refused_by_classification_with_a_hint(tmp_path: Path, capsys) -> None:
    from hpctrain.cli import main

    root = _table(tmp_path)
    code = main(["train", *_keys(root, "data.label_column=y1", "model.name=tests.tasks.test_regression:mlp"),
                 f"run.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2 and "not a whole number" in err and "hint: train.task=regression" in err, err


def _dataset(n: int = 13) -> TensorDataset:
    x = torch.tensor([_features(i) for i in range(n)])
    return TensorDataset(x, (x[:, 0] * 2 - x[:, 1]).double())  # float64 targets: read as float32


def _eval(env: ClusterEnv) -> dict[str, Any]:
    loader = EvalLoader(_dataset(), env, 4, targets="float")
    metrics = [*Regression().metrics(1), *user_metrics("tests.tasks.test_regression:MaxScaledError")]
    return evaluate(mlp(1), loader, metrics, env, CPU, task=Regression()).metrics


def test_public_loaders_and_evaluate_take_float_targets_exactly_over_ranks() -> None:
    data = _dataset()
    batch = next(iter(MemoryLoader(data, ClusterEnv(), 4, shuffle=False, targets="float")))
    assert batch.targets.dtype == torch.float32 and batch.targets.tolist() == data.tensors[1][:4].float().tolist()
    with pytest.raises(UserError, match="not a whole number.*train.task=regression"):
        next(iter(EvalLoader(data, ClusterEnv(), 4)))  # the default (class ids) still checks
    with torch.no_grad():
        pred = mlp(1)(data.tensors[0]).squeeze(1).double()
    err = pred - data.tensors[1].float().double()
    one, two = _eval(ClusterEnv()), run_ranks(2, _eval)
    assert one["count"] == 13 and math.isclose(one["mse"], float(err.square().mean()), rel_tol=1e-9)
    assert math.isclose(one["mae"], float(err.abs().mean()), rel_tol=1e-9)
    for rank in two:
        assert rank["count"] == 13 and all(math.isclose(rank[k], one[k], rel_tol=1e-6)  # float32 forward
                                           for k in ("mse", "mae", "scaled_mae"))
    plain = evaluate_dataset(mlp(1), data, 5, task="regression").metrics
    assert math.isclose(plain["loss"], one["mse"], rel_tol=1e-6)
