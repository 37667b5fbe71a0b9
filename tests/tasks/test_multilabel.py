"""Multi-label: 0/1 vectors train with BCE-with-logits; per-label accuracy and F1 are exact over
ranks (summed true/false positive/negative counts), equal to a hand computation; a JSON-lines
table with a list column trains at 2 ranks; targets other than 0/1 exit 2 naming the row."""

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
from hpctrain.data.in_memory import EvalLoader
from hpctrain.evaluation.evaluate import evaluate
from hpctrain.tasks import Multilabel
from hpctrain.tasks.metrics import EvalOutput, MultilabelMetrics
from tests.dist_utils import run_ranks, train_cases

CPU = torch.device("cpu")
LABELS = 3


def mlp(num_classes: int = LABELS) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.ReLU(), torch.nn.Linear(8, num_classes))


def test_f1_and_accuracy_per_label_equal_a_hand_count() -> None:
    logits = torch.tensor([[1.0, -1.0, 2.0], [1.0, 1.0, -1.0], [-1.0, -2.0, -3.0], [3.0, -1.0, 1.0]])
    targets = torch.tensor([[1, 0, 0], [1, 0, 0], [0, 1, 0], [0, 0, 1]], dtype=torch.float32)
    # predicted: [1,0,1] [1,1,0] [0,0,0] [1,0,1]
    # label 0: tp 2 fp 1 fn 0 tn 1; label 1: tp 0 fp 1 fn 1 tn 2; label 2: tp 1 fp 1 fn 0 tn 2
    metric = MultilabelMetrics(LABELS)
    losses = Multilabel().target_losses(logits, targets).double()
    metric.update(EvalOutput(logits, targets, losses))
    out = metric.compute()
    assert out["per_label_f1"] == [4 / 5, 0.0, 2 / 3]
    assert out["per_label_accuracy"] == [3 / 4, 2 / 4, 3 / 4]
    assert out["f1"] == 2 * 3 / (2 * 3 + 3 + 1) and out["accuracy"] == 8 / 12
    assert math.isclose(out["macro_f1"], (4 / 5 + 2 / 3) / 3) and out["exact_match"] == 0.0 and out["count"] == 4
    bce = torch.nn.functional.binary_cross_entropy_with_logits(logits, targets)
    assert math.isclose(out["loss"], float(bce), rel_tol=1e-6)


def _dataset(n: int = 11) -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 2, generator=g)
    y = torch.stack([x[:, 0] > 0, x[:, 1] > 0, x.sum(1) > 0.5], 1).long()  # 0/1 as integers: read as float
    return TensorDataset(x, y)


def _eval(env: ClusterEnv) -> dict[str, Any]:
    loader = EvalLoader(_dataset(), env, 3, targets="multilabel")
    return evaluate(mlp(), loader, Multilabel().metrics(LABELS), env, CPU, task=Multilabel()).metrics


def test_multilabel_evaluation_is_exact_over_ranks() -> None:
    x, y = _dataset().tensors
    with torch.no_grad():
        pred = mlp()(x) > 0
    truth = y.bool()
    tp, fp, fn = ((pred & truth).sum(0), (pred & ~truth).sum(0), (~pred & truth).sum(0))
    hand = [2 * int(a) / (2 * int(a) + int(b) + int(c)) if a + b + c else 1.0 for a, b, c in zip(tp, fp, fn)]
    one = _eval(ClusterEnv())
    assert one["per_label_f1"] == hand and one["count"] == 11
    for rank in run_ranks(2, _eval):
        assert rank["per_label_f1"] == hand and rank["f1"] == one["f1"] and rank["count"] == 11
        assert rank["per_label_accuracy"] == one["per_label_accuracy"]
    bad = TensorDataset(torch.zeros(2, 2), torch.tensor([[0, 1, 2], [0, 0, 1]]))
    with pytest.raises(UserError, match=r"\[0\] has targets \[0, 1, 2\], not 0/1"):
        next(iter(EvalLoader(bad, ClusterEnv(), 2, targets="multilabel")))


def _write(path: Path, rows: range, bad: bool = False) -> None:
    lines = []
    for i in rows:
        a, b = math.sin(i), math.cos(1.3 * i)
        tags = [int(a > 0), int(b > 0), 2 if bad and i == rows[1] else int(a + b > 0.5)]
        lines.append(json.dumps({"a": a, "b": b, "tags": tags}))
    path.write_text("\n".join(lines) + "\n")


def test_a_table_with_a_list_column_trains_multilabel_at_two_ranks(tmp_path: Path, capsys) -> None:
    pytest.importorskip("pyarrow")
    root = tmp_path / "ml"
    root.mkdir()
    _write(root / "train.jsonl", range(40))
    _write(root / "val.jsonl", range(100, 117))
    keys = [f"data.name=jsonl:{root}", "data.label_column=tags", "data.input_columns=[a,b]", "train.task=multilabel",
            "model.name=tests.tasks.test_multilabel:mlp", "data.batch_size=4", "train.epochs=2", "optim.lr=0.1",
            "train.progress=false", "checkpoint.enabled=false"]
    (got,) = train_cases(2, [("ml", keys)], tmp_path / "runs", keep=("val_count", "task", "val_accuracy"))[:1]
    assert isinstance(got["ml"], dict), got
    assert got["ml"]["val_count"] == 17 and got["ml"]["task"] == "multilabel"
    model = mlp()
    model.load_state_dict(torch.load(tmp_path / "runs" / "ml" / "model.pt", weights_only=True))
    records = [json.loads(line) for line in (root / "val.jsonl").read_text().splitlines()]
    with torch.no_grad():
        pred = model(torch.tensor([[r["a"], r["b"]] for r in records], dtype=torch.float32)) > 0
    truth = torch.tensor([r["tags"] for r in records]).bool()
    tp, fp, fn = int((pred & truth).sum()), int((pred & ~truth).sum()), int((~pred & truth).sum())
    rows = [json.loads(line) for line in (tmp_path / "runs" / "ml" / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if "val_f1" in r][-1]
    assert last["val_f1"] == 2 * tp / (2 * tp + fp + fn)
    assert got["ml"]["val_accuracy"] == int((pred == truth).sum()) / truth.numel()
    _write(root / "val.jsonl", range(100, 117), bad=True)
    from hpctrain.cli import main

    code = main(["train", *keys, f"run.dir={tmp_path / 'bad'}"])
    err = capsys.readouterr().err
    assert code == 2 and "val.jsonl row 1" in err and "multilabel needs a 0/1 vector per row" in err, err
