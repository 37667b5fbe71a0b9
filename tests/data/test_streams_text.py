"""Streams and text as users have them (issue 24, point 5): an IterableDataset without ``__len__``
trains to ``train.max_steps`` (refused without it, exit 2, naming the stream); a ``jsonl:`` or
``parquet:`` text column feeds ``train.task=causal_lm`` as byte tokens; ``hpctrain data shard
text:`` keeps a corpus's own split (``--split`` takes the whole PATH, ``train/`` and ``val/``
folders are the splits) and ``--val-fraction 0`` / ``1`` work where they make sense."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset

from hpctrain.cli import main
from hpctrain.config import load_config
from hpctrain.data.text import read_documents, windows
from hpctrain.train import train

MOD = "tests.data.test_streams_text"
FEATURES, CLASSES = 6, 3
SEQ = 16
READ: list[int] = []  # the items the endless stream handed out (in-process runs)


def _sample(i: int) -> tuple[torch.Tensor, int]:
    x = torch.randn(FEATURES, generator=torch.Generator().manual_seed(i))
    x[i % CLASSES] += 2.0
    return x, i % CLASSES


class Endless(IterableDataset):
    """A stream that never ends and has no ``__len__``: a sensor, a generator, a web crawl."""

    def __iter__(self) -> Iterator[tuple[torch.Tensor, int]]:
        i = 0
        while True:
            READ.append(i)
            yield _sample(i)
            i += 1


class Fixed(Dataset):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return _sample(10_000 + i)


def endless() -> dict[str, Any]:
    return {"train": Endless(), "val": Fixed(), "num_classes": CLASSES}


def mlp(num_classes: int = CLASSES) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 8), torch.nn.ReLU(), torch.nn.Linear(8, num_classes))


def _keys(tmp_path: Path, *extra: str) -> list[str]:
    return ["train.progress=false", "checkpoint.enabled=false", "train.threads=1", f"run.dir={tmp_path / 'run'}",
            *extra]


# ---------------------------------------------------------------- streams without __len__


def test_a_stream_without_len_trains_to_max_steps(tmp_path: Path) -> None:
    READ.clear()
    cfg = load_config(None, _keys(tmp_path, f"model.name={MOD}:mlp", f"data.name={MOD}:endless", "data.batch_size=4",
                                  "train.max_steps=5", "train.grad_accum=2"))
    summary = train(cfg)
    assert summary["steps"] == 5 and summary["val_count"] == 12
    # the template's first item, then 5 steps x 2 micro-batches x 4 samples, read in order
    assert READ == [0, *range(40)], READ


def test_a_stream_without_len_and_without_max_steps_exits_2_naming_it(tmp_path: Path, capsys) -> None:
    code = main(["train", f"model.name={MOD}:mlp", f"data.name={MOD}:endless", "data.batch_size=4",
                 *_keys(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert f"data.name={MOD}:endless train: the IterableDataset Endless has no __len__" in err
    assert "hint: set train.max_steps" in err


# ---------------------------------------------------------------- text columns for causal_lm


TEXTS = ["It was the best of times, it was the worst of times, it was the age of wisdom.",
         "Call me Ishmael. Some years ago, never mind how long precisely, having little money.",
         "short",
         "In the beginning the Universe was created. This has made a lot of people very angry."]


def _windows(texts: list[str]) -> int:
    return sum(len(windows(t.encode(), SEQ)) for t in texts)


def _jsonl(path: Path, texts: list[str], key: str = "text") -> None:
    path.write_text("".join(json.dumps({key: t, "id": i}) + "\n" for i, t in enumerate(texts)))


def _lm_keys(tmp_path: Path, name: str, *extra: str) -> list[str]:
    return _keys(tmp_path, "model.name=gpt", f"data.name={name}", "train.task=causal_lm", f"model.seq_len={SEQ}",
                 "model.n_layers=1", "model.hidden=16", "model.heads=2", "data.batch_size=2", "train.max_steps=2",
                 *extra)


def test_a_jsonl_text_column_feeds_a_causal_lm(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    _jsonl(corpus / "train.jsonl", TEXTS * 2)
    _jsonl(corpus / "val.jsonl", TEXTS[:2])
    summary = train(load_config(None, _lm_keys(tmp_path, f"jsonl:{corpus}")))
    assert summary["steps"] == 2
    assert summary["val_count"] == _windows(TEXTS[:2]) == 9  # every window of the val rows, none across rows
    assert summary["val_perplexity"] is not None


def test_a_parquet_text_column_named_by_input_key(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    pq.write_table(pa.table({"body": TEXTS * 2, "n": list(range(8))}), corpus / "train.parquet")
    pq.write_table(pa.table({"body": TEXTS[1:2], "n": [0]}), corpus / "val.parquet")
    summary = train(load_config(None, _lm_keys(tmp_path, f"parquet:{corpus}", "data.input_key=body")))
    assert summary["steps"] == 2 and summary["val_count"] == _windows(TEXTS[1:2]) == 5


def test_a_table_without_a_text_column_names_its_columns(tmp_path: Path, capsys) -> None:
    _jsonl(tmp_path / "t.jsonl", TEXTS, key="body")
    code = main(["train", *_lm_keys(tmp_path, f"jsonl:{tmp_path / 't.jsonl'}")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "has no text column 'text / content / document'; its columns are ['body', 'id']" in err
    assert "hint: data.input_key=COLUMN" in err


# ---------------------------------------------------------------- hpctrain data shard text: keeps the split


def _corpus(root: Path, n: int, prefix: str) -> None:
    root.mkdir(parents=True)
    for i in range(n):
        (root / f"{prefix}{i:03d}.txt").write_text(f"document {i} " * 8)


def _docs(out: Path, split: str) -> list[str]:
    manifest = json.loads((out / f"{split}.manifest.json").read_text())
    return sorted(d["name"] for d in manifest["documents"])


def test_split_names_the_whole_path_as_that_split(tmp_path: Path) -> None:
    _corpus(tmp_path / "c" / "train", 30, "t")
    _corpus(tmp_path / "c" / "val", 7, "v")
    out = tmp_path / "s"
    for split in ("train", "val"):
        args = ["data", "shard", f"text:{tmp_path / 'c' / split}", str(out), "--split", split, "--seq-len", "16",
                "--quiet"]
        assert main(args) == 0
    assert len(_docs(out, "train")) == 30 and len(_docs(out, "val")) == 7  # not 27 and 6: no re-split


def test_a_corpus_with_train_and_val_folders_keeps_them(tmp_path: Path) -> None:
    _corpus(tmp_path / "c" / "train", 30, "t")
    _corpus(tmp_path / "c" / "validation", 7, "v")
    out = tmp_path / "s"
    assert main(["data", "shard", f"text:{tmp_path / 'c'}", str(out), "--seq-len", "16", "--quiet"]) == 0
    assert _docs(out, "train") == sorted(f"t{i:03d}.txt" for i in range(30))
    assert _docs(out, "val") == sorted(f"v{i:03d}.txt" for i in range(7))
    assert [d.name for d in read_documents(tmp_path / "c" / "train")][:1] == ["t000.txt"]


def test_val_fraction_0_and_1(tmp_path: Path, capsys) -> None:
    _corpus(tmp_path / "c", 10, "d")
    out0 = tmp_path / "s0"
    assert main(["data", "shard", f"text:{tmp_path / 'c'}", str(out0), "--val-fraction", "0", "--seq-len", "16",
                 "--quiet"]) == 0
    assert len(_docs(out0, "train")) == 10 and not (out0 / "val.manifest.json").exists()
    out1 = tmp_path / "s1"
    assert main(["data", "shard", f"text:{tmp_path / 'c'}", str(out1), "--val-fraction", "1", "--split", "val",
                 "--seq-len", "16", "--quiet"]) == 0
    assert len(_docs(out1, "val")) == 10
    capsys.readouterr()
    assert main(["data", "shard", f"text:{tmp_path / 'c'}", str(tmp_path / "s2"), "--val-fraction", "1",
                 "--seq-len", "16", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "--val-fraction 1 leaves no train documents" in err and "hint: --split val" in err
