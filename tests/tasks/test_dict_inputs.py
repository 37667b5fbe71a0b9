"""Every input the model takes: a tiny Hugging Face BERT (built from a config, no download)
trains at 2 ranks on an ``hf:`` dataset saved with save_to_disk, its attention_mask and
token_type_ids reaching ``model(**inputs)``, and [PAD] attended to by nobody; a collate may
return a dict; causal_lm's per-token val_loss and token counts skip padding."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from hpctrain.config.data import DataConfig
from hpctrain.core.env import ClusterEnv
from hpctrain.data.batch import Batch, ItemDataset, ItemSpec
from hpctrain.tasks import CausalLM, Classification
from hpctrain.tasks.inputs import call_model
from hpctrain.telemetry.meter import Meter
from tests.dist_utils import train_cases

CPU = torch.device("cpu")
PAD, LENGTH, VOCAB = 0, 10, 30

# transformers and datasets: imported by the tests that use them (tests/tasks/hf_bert.py)
needs_hf = pytest.mark.skipif(importlib.util.find_spec("transformers") is None
                              or importlib.util.find_spec("datasets") is None,
                              reason="transformers and datasets are not installed")


@needs_hf
def test_a_padded_bert_trains_at_two_ranks_with_its_masks(tmp_path: Path) -> None:
    from tests.tasks.hf_bert import save_dataset

    path = save_dataset(tmp_path)
    keys = [f"data.name=hf:{path}", "model.name=tests.tasks.hf_bert:bert", "data.batch_size=4",
            "train.max_steps=3", "train.progress=false", "checkpoint.enabled=false"]
    (rank0, _) = train_cases(2, [("bert", keys)], tmp_path / "runs", keep=("val_count", "val_loss", "tokens_per_s"))
    assert isinstance(rank0["bert"], dict), rank0  # else: the mask did not reach the model
    assert rank0["bert"]["val_count"] == 9 and rank0["bert"]["tokens_per_s"] is not None


@needs_hf
def test_padding_is_not_attended_and_the_mask_reaches_evaluation(tmp_path: Path) -> None:
    from hpctrain.data import build_data
    from tests.tasks.hf_bert import bert, save_dataset

    path = save_dataset(tmp_path)
    bundle = build_data(DataConfig(name=f"hf:{path}", batch_size=4), ClusterEnv(), CPU, seed=0)
    assert bundle.input_shape == (LENGTH,) and bundle.input_dtype == torch.int64
    batch = next(iter(bundle.val_loader))
    assert sorted(batch.inputs) == ["attention_mask", "input_ids", "token_type_ids"]
    model = bert().eval()
    out = Classification().eval_step(model, batch, None)
    assert out is not None
    for row, ids in enumerate(batch.inputs["input_ids"]):  # each sample alone, without any [PAD]
        real = ids[ids != PAD].unsqueeze(0)
        with torch.no_grad():
            alone = model(input_ids=real, attention_mask=torch.ones_like(real), token_type_ids=torch.zeros_like(real))
        torch.testing.assert_close(out.logits[row], alone.logits[0], rtol=1e-5, atol=1e-5)
    assert Classification().count_tokens(batch.inputs, batch.targets) == int(batch.inputs["attention_mask"].sum())


class _Items(Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"tokens": [1 + i] * (i + 1), "y": i % 2}


def collate(items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """A user's collate that pads and returns a dict, as Hugging Face's collators do."""
    ids = torch.full((len(items), 5), PAD)
    for row, item in enumerate(items):
        ids[row, : len(item["tokens"])] = torch.tensor(item["tokens"])
    return {"input_ids": ids, "attention_mask": (ids != PAD).long(), "labels": torch.tensor([x["y"] for x in items])}


def test_a_collate_may_return_a_dict_and_the_model_is_called_by_name() -> None:
    data = ItemDataset(_Items(), ItemSpec("items", collate=collate, num_classes=2))
    batch = data.__getitems__([0, 1, 2, 3])
    assert sorted(batch.inputs) == ["attention_mask", "input_ids"] and batch.targets.tolist() == [0, 1, 0, 1]
    seen: dict[str, Any] = {}

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(8, 2)

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            seen.update(input_ids=input_ids, attention_mask=attention_mask)
            return (self.emb(input_ids) * attention_mask.unsqueeze(-1)).sum(1)

    call_model(Net(), batch.inputs)
    assert torch.equal(seen["attention_mask"], batch.inputs["attention_mask"])


class _Bigram(torch.nn.Module):
    """Logits of the next token from the current one only: padding cannot leak into real positions."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.table = torch.nn.Embedding(VOCAB, VOCAB)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.table(input_ids)


def test_per_token_val_loss_and_token_counts_skip_padding() -> None:
    windows = torch.tensor([[3, 4, 5, 6, 7], [8, 9, PAD, PAD, PAD]])
    mask = (windows != PAD).long()
    mask[1, 2:] = 0
    task, model = CausalLM(), _Bigram()
    batch = Batch({"input_ids": windows, "attention_mask": mask}, torch.zeros(2, dtype=torch.long), [0, 1])
    out = task.eval_step(model, batch, None)
    assert out is not None
    metric = task.metrics(VOCAB)[0]
    metric.update(out)
    result = metric.compute()
    logits = model.table(windows[:, :-1]).detach()
    real = [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0)]  # (sample, position) whose target token is real
    hand = sum(float(F.cross_entropy(logits[i, t], windows[i, t + 1])) for i, t in real) / len(real)
    assert result["tokens"] == 5 and math.isclose(result["loss"], hand, rel_tol=1e-6)
    inputs, targets = task.split(batch)
    assert task.count_tokens(inputs, targets) == 5
    meter = Meter(global_batch=2, step=0, world_size=2, tokens_each_step=True)  # tokens/s counts them per step
    meter.add_tokens(task.count_tokens(inputs, targets))
    meter.add_tokens(task.count_tokens(*task.split(Batch(windows, batch.targets, [0, 1]))))  # unpadded: 2 x 4
    assert float(meter._tokens) == 5 + 8  # what the next row's tokens_per_s counts
    with torch.no_grad():
        assert math.isclose(float(task.loss(model(**inputs), targets, None)), hand, rel_tol=1e-6)
    other = windows.clone()
    other[1, 3:] = 17  # whatever sits at padded positions changes nothing
    again = task.eval_step(model, Batch({"input_ids": other, "attention_mask": mask}, batch.targets, [0, 1]), None)
    assert again is not None and torch.equal(again.losses[again.targets != -100], out.losses[out.targets != -100])
