"""The tiny Hugging Face BERT and the ``hf:`` dataset of tests/tasks/test_dict_inputs.py, in a module
of their own: transformers and datasets (~2 s of CPU) are imported by the worker and the ranks
that run those tests, not by every xdist worker collecting the test file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import datasets
import torch
import transformers

from tests.tasks.test_dict_inputs import LENGTH, PAD, VOCAB


class MaskedBert(transformers.BertForSequenceClassification):
    """A BERT that refuses a padded batch without its mask, or a mask that is not the data's:
    the proof that attention_mask (and token_type_ids) reach the model in training and eval."""

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None) -> Any:
        assert input_ids is not None
        if bool((input_ids != PAD).any()):  # the dummy forward of the model check is all [PAD]
            if attention_mask is None or token_type_ids is None:
                raise RuntimeError("attention_mask / token_type_ids did not reach the model")
            if not torch.equal(attention_mask.bool(), input_ids != PAD):
                raise RuntimeError("the attention_mask is not the data's")
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)


def bert(num_classes: int = 2) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=LENGTH, num_labels=num_classes,
                                     pad_token_id=PAD, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return MaskedBert(config)


def _rows(n: int, offset: int) -> dict[str, list[Any]]:
    rows: dict[str, list[Any]] = {"text": [], "input_ids": [], "attention_mask": [], "token_type_ids": [], "label": []}
    for i in range(offset, offset + n):
        length = 3 + i % (LENGTH - 3)
        ids = [1 + (7 * i + 3 * k) % (VOCAB - 1) for k in range(length)]
        rows["text"].append(f"sample {i}")  # a text column beside the tokens: skipped, not refused
        rows["input_ids"].append(ids + [PAD] * (LENGTH - length))
        rows["attention_mask"].append([1] * length + [0] * (LENGTH - length))
        rows["token_type_ids"].append([0] * LENGTH)
        rows["label"].append(int(sum(ids) % 2))
    return rows


def save_dataset(root: Path) -> Path:
    splits = {"train": datasets.Dataset.from_dict(_rows(32, 0)), "validation": datasets.Dataset.from_dict(_rows(9, 50))}
    datasets.DatasetDict(splits).save_to_disk(str(root / "hf"))
    return root / "hf"
