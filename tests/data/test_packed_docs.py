"""Packed documents for causal LMs (issue 28, point 3, data side): ``data.packing=documents`` /
``hpctrain data shard --packing documents`` pack documents into windows with per-token document
ids; targets are -100 across a boundary and on padding, the loss is the mean over the real
targets, a Hugging Face tokenizer directory tokenizes (offline), resume mid-epoch is exact,
throughput and MFU count real tokens, and a tiny GPT trains on it end to end."""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hpctrain.checkpoint import layout
from hpctrain.cli import main
from hpctrain.config import load_config
from hpctrain.core.env import ClusterEnv
from hpctrain.data.batch import Batch
from hpctrain.data.loader import ShardedEvalLoader
from hpctrain.data.packed import PAD_DOC, byte_tokenizer, doc_bounds, doc_ids_of, load_tokenizer, pack_documents
from hpctrain.data.text import tokens_of
from hpctrain.models.gpt import GPT
from hpctrain.tasks.causal_lm import CausalLM
from hpctrain.tasks.inputs import IGNORE_INDEX, call_model, expand_dict_inputs, forward_names, model_inputs
from hpctrain.telemetry.flops import Peak
from hpctrain.telemetry.meter import Meter
from hpctrain.train import train

SEQ = 8
TEXTS = ["the cat sat on the mat", "a dog ran", "the cat ran on the mat and the dog sat", "cat",
         "on the mat a dog and a cat sat and ran and sat", "the dog"]


def unpack(tokens: np.ndarray, doc_ids: np.ndarray) -> list[list[int]]:
    """The documents back from windows in their order: a window's doc 0 continues the previous
    window's last document when that window's last token (the overlap) is in the same document."""
    docs: list[list[int]] = []
    seq = tokens.shape[1] - 1
    for k in range(len(tokens)):
        last = k == len(tokens) - 1
        span = range(seq + 1) if last else range(seq)  # the overlap token is the next window's first
        continues = k > 0 and doc_ids[k - 1][seq] == doc_ids[k - 1][seq - 1]
        for t in span:
            d = int(doc_ids[k][t])
            if d == PAD_DOC:
                continue
            if t == 0 and continues:
                docs[-1].append(int(tokens[k][t]))
            elif t == 0 or d != doc_ids[k][t - 1]:
                docs.append([int(tokens[k][t])])
            else:
                docs[-1].append(int(tokens[k][t]))
    return docs


# ---------------------------------------------------------------- packing


@pytest.mark.parametrize("seq", [3, 5, 8])
def test_packing_round_trip_keeps_every_document_once_in_order(seq: int) -> None:
    rng = np.random.default_rng(seq)
    docs = [rng.integers(0, 50, n) for n in (1, 7, 0, 2, 13, 1, 1, 4, 30, 5)]  # 0: an empty document
    packed = pack_documents(docs, seq)
    assert packed.tokens.shape == packed.doc_ids.shape == (len(packed), seq + 1)
    assert packed.doc_ids.dtype == np.int32
    assert unpack(packed.tokens, packed.doc_ids) == [d.tolist() for d in docs if len(d)]
    n_tokens = sum(len(d) for d in docs)
    real = packed.doc_ids != PAD_DOC
    assert real[:-1].all() and real[-1].all() == ((n_tokens - 1) % seq == 0)  # only the last window is padded
    assert (packed.doc_ids[:, 0] == 0).all()  # ids count documents within the window
    for row, ok in zip(packed.doc_ids, real):
        assert (np.diff(row[ok]) >= 0).all() and set(np.diff(row[ok]).tolist()) <= {0, 1}
        np.testing.assert_array_equal(doc_ids_of(doc_bounds(row), seq + 1), row)  # the shard form
    assert len(packed) == -(-(n_tokens - 1) // seq)  # every token but the first is a target once


def test_targets_are_minus_100_exactly_at_boundaries_and_padding() -> None:
    packed = pack_documents([np.array([1, 2, 3]), np.array([4, 5]), np.array([6, 7, 8, 9])], 4)
    np.testing.assert_array_equal(packed.tokens, [[1, 2, 3, 4, 5], [5, 6, 7, 8, 9]])
    np.testing.assert_array_equal(packed.doc_ids, [[0, 0, 0, 1, 1], [0, 1, 1, 1, 1]])
    tail = pack_documents([np.array([1, 2, 3, 4, 5, 6])], 4)
    np.testing.assert_array_equal(tail.doc_ids, [[0, 0, 0, 0, 0], [0, 0, -1, -1, -1]])
    tokens = torch.from_numpy(np.concatenate([packed.tokens, tail.tokens]).astype(np.int64))
    docs = torch.from_numpy(np.concatenate([packed.doc_ids, tail.doc_ids]))
    for inputs_of in ({"tokens": tokens, "doc_ids": docs}, torch.stack([tokens, docs.long()], 1)):  # memory, shards
        inputs, targets = CausalLM().split(Batch(inputs_of, torch.zeros(4, dtype=torch.long), torch.arange(4)))
        assert list(inputs) == ["tokens", "doc_ids"] and inputs["doc_ids"].dtype == torch.int32
        assert inputs["tokens"].tolist() == [[1, 2, 3, 4], [5, 6, 7, 8], [1, 2, 3, 4], [5, 6, 0, 0]]
        # padding's id is past every document's (4 = the window's length): the ids stay non-decreasing
        assert inputs["doc_ids"].tolist() == [[0, 0, 0, 1], [0, 1, 1, 1], [0, 0, 0, 0], [0, 0, 4, 4]]
        assert targets.tolist() == [[2, 3, -100, 5], [-100, 7, 8, 9], [2, 3, 4, 5], [6, -100, -100, -100]]
        # a model with its own loss (labels = its inputs, shifted by the model): -100 at document starts and padding
        assert CausalLM().labels(inputs, targets).tolist() == [[1, 2, 3, -100], [5, -100, 7, 8], [1, 2, 3, 4],
                                                              [5, 6, -100, -100]]
        count = CausalLM().count_tokens(inputs, targets)
        assert count is not None and int(count) == 14  # every token read but padding


def test_the_loss_is_the_mean_over_the_real_targets() -> None:
    packed = pack_documents([np.arange(1, 6), np.arange(6, 9), np.arange(9, 18)], 6)
    batch = Batch({"tokens": torch.from_numpy(packed.tokens.astype(np.int64)), "doc_ids": torch.from_numpy(
        packed.doc_ids)}, torch.zeros(len(packed), dtype=torch.long), torch.arange(len(packed)))
    task = CausalLM()
    inputs, targets = task.split(batch)
    logits = torch.randn(*targets.shape, 20, generator=torch.Generator().manual_seed(0))
    real = targets != IGNORE_INDEX
    want = -F.log_softmax(logits, -1).gather(-1, targets.clamp_min(0)[..., None])[..., 0][real].mean()
    assert real.numel() == 18 and int(real.sum()) == 17 - 1 - 2  # 17 tokens: the first and 2 document starts no targets
    assert abs(float(task.loss(logits, targets, None)) - float(want)) < 1e-6  # (assert_close imports DTensor: 2 s)


# ---------------------------------------------------------------- models without doc_ids


class Plain(nn.Module):
    """A causal LM whose forward names no doc_ids (a Hugging Face model's input_ids)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 4)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.emb(input_ids)


class Masked(Plain):
    def forward(self, tokens: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
        assert doc_ids is not None
        return self.emb(tokens) + doc_ids[..., None]


def test_packed_inputs_reach_a_model_by_its_forward_and_crossing_attention_is_warned_once(caplog) -> None:
    tokens, docs = torch.tensor([[1, 2, 3]]), torch.tensor([[0, 0, 1]], dtype=torch.int32)
    inputs = model_inputs({"tokens": tokens, "doc_ids": docs})
    plain, masked = Plain(), Masked()
    expand_dict_inputs(plain)
    expand_dict_inputs(masked)
    with caplog.at_level(logging.WARNING, logger="hpctrain"):
        assert torch.equal(plain(inputs), plain.emb(tokens))  # the tokens, positionally: input_ids
        assert torch.equal(call_model(plain, inputs), plain.emb(tokens))
        assert torch.equal(masked(inputs), masked.emb(tokens) + docs[..., None])
    warned = [r.getMessage() for r in caplog.records if "takes no doc_ids" in r.getMessage()]
    assert warned == ["Plain.forward takes no doc_ids: its attention crosses the packed documents of a window (the "
                      "loss still predicts no token across a boundary); hint: a model with forward(tokens, "
                      "doc_ids=None) (gpt, llama), or data.packing=windows"]


# ---------------------------------------------------------------- a tokenizer directory, shards


@pytest.fixture(scope="module")
def tokdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny word-level tokenizer saved as a Hugging Face tokenizer directory (built here, never downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(TEXTS, trainers.WordLevelTrainer(special_tokens=["[UNK]", "[BOS]"]))
    tok.post_processor = processors.TemplateProcessing(single="[BOS] $A", special_tokens=[("[BOS]", 1)])
    root = tmp_path_factory.mktemp("tok")
    tok.save(str(root / "tokenizer.json"))
    return root


def test_a_tokenizer_directory_packs_shards_that_read_back_exactly(tokdir: Path, tmp_path: Path, capsys) -> None:
    tok = load_tokenizer(str(tokdir))
    assert tok.vocab_size == 11 and tok.encode(["the dog"])[0].tolist()[0] == 1  # [BOS] starts each document
    corpus = tmp_path / "docs"
    corpus.mkdir()
    for i, text in enumerate(TEXTS):
        (corpus / f"d{i}.txt").write_text(text)
    out = tmp_path / "shards"
    assert main(["data", "shard", f"text:{corpus}", str(out), "--split", "train", "--seq-len", str(SEQ),
                 "--packing", "documents", "--tokenizer", str(tokdir), "--quiet"]) == 0
    manifest = json.loads((out / "train.manifest.json").read_text())
    assert (manifest["packing"], manifest["tokenizer"], manifest["vocab_size"]) == ("documents", str(tokdir), 11)
    batches = list(ShardedEvalLoader(out, ClusterEnv(), 64, split="train", transform=tokens_of))
    keys = [k for b in batches for k in b.keys]
    by_key = torch.cat([b.inputs for b in batches])[np.argsort(keys)].numpy()
    rows = np.empty_like(by_key)
    rows[np.random.default_rng(0).permutation(len(rows))] = by_key  # key i holds window order[i] (text.py's mix)
    assert rows.shape[1:] == (2, SEQ + 1)
    assert unpack(rows[:, 0], rows[:, 1]) == [t.tolist() for t in tok.encode(TEXTS)]

    # the model's vocabulary must hold the tokenizer's: refused before training, exit 2, one line
    capsys.readouterr()
    code = main(["train", "model.name=gpt", "data.name=shards", f"data.path={out}", f"model.seq_len={SEQ}",
                 "model.vocab=8", "data.batch_size=1", "model.n_layers=1", "model.hidden=8", "model.heads=2",
                 "train.max_steps=1", "train.progress=false", "checkpoint.enabled=false",
                 f"run.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert "model.vocab=8 is smaller than the data's vocabulary (11)" in err
    capsys.readouterr()
    assert main(["data", "shard", f"text:{corpus}", str(tmp_path / "x"), "--split", "train", "--packing", "documents",
                 "--tokenizer", str(tmp_path / "nowhere"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"--tokenizer={tmp_path / 'nowhere'}: no such directory" in err and len(err.strip().splitlines()) == 1
    table = _jsonl(tmp_path / "table")  # a table sharded as inputs and labels takes no tokenizer
    assert main(["data", "shard", f"jsonl:{table}", str(tmp_path / "y"), "--tokenizer", str(tokdir), "--quiet"]) == 2
    assert "hint: --packing documents packs its text column" in capsys.readouterr().err


# ---------------------------------------------------------------- training: end to end, resume, real tokens


def _jsonl(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS * 2))
    (root / "val.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS[:3]))
    return root


def _keys(tmp_path: Path, name: str, *extra: str) -> list[str]:
    return ["model.name=gpt", f"data.name={name}", "train.task=causal_lm", f"model.seq_len={SEQ}", "model.n_layers=1",
            "model.hidden=16", "model.heads=2", "train.progress=false", "train.threads=1", "train.log_every=1",
            "checkpoint.every_seconds=None", f"run.dir={tmp_path}", "data.packing=documents", *extra]


def test_a_tiny_gpt_trains_on_packed_documents_counting_real_tokens(tmp_path: Path, monkeypatch, caplog) -> None:
    counted: list[int] = []
    add = Meter.add_tokens

    def counting(self: Meter, n: torch.Tensor) -> None:
        counted.append(int(n))
        add(self, n)
    monkeypatch.setattr(Meter, "add_tokens", counting)
    given: list[bool] = []  # did the model's forward get the doc ids?
    forward = GPT.forward

    @functools.wraps(forward)
    def spy(self: GPT, *args: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
        given.append(kwargs.get("doc_ids") is not None)
        return forward(self, *args, **kwargs)
    monkeypatch.setattr(GPT, "forward", spy)
    corpus = _jsonl(tmp_path / "corpus")
    byte = byte_tokenizer()
    train_windows = pack_documents(byte.encode(TEXTS * 2), SEQ)
    val_windows = pack_documents(byte.encode(TEXTS[:3]), SEQ)
    with caplog.at_level(logging.WARNING, logger="hpctrain"):
        summary = train(load_config(None, _keys(tmp_path / "run", f"jsonl:{corpus}", "data.batch_size=4",
                                                "train.epochs=1", "checkpoint.enabled=false")))
    assert summary["steps"] * 4 == len(train_windows) == 32
    assert summary["val_count"] == len(val_windows) and np.isfinite(summary["val_loss"])
    # tokens/s counts every token read but padding: here each window once, the last one padded
    assert sum(counted) == int((train_windows.doc_ids[:, :-1] != PAD_DOC).sum()) == 32 * SEQ - 6
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["tokens_per_s"] > 0 for r in rows if "loss" in r)
    warned = sum("takes no doc_ids" in r.getMessage() for r in caplog.records)
    # until gpt's forward takes doc_ids (its attention masked per document) the run says once that it crosses them
    takes = "doc_ids" in forward_names(GPT())[0]
    assert warned == (0 if takes else 1)
    val_batches = -(-len(val_windows) // 8)  # eval batches of 2 x data.batch_size
    assert given.count(True) == (summary["steps"] + val_batches if takes else 0)  # every forward of a packed batch


def test_packed_shards_of_a_jsonl_text_column_resume_mid_epoch_exactly(tmp_path: Path) -> None:
    corpus = _jsonl(tmp_path / "corpus")
    shards = tmp_path / "shards"
    for split in ("train", "val"):
        assert main(["data", "shard", f"jsonl:{corpus}", str(shards), "--split", split, "--seq-len", str(SEQ),
                     "--packing", "documents", "--samples-per-shard", "7", "--quiet"]) == 0
    train_windows = pack_documents(byte_tokenizer().encode(TEXTS * 2), SEQ)
    assert json.loads((shards / "train.manifest.json").read_text())["total_samples"] == len(train_windows)
    keys = ["data.name=shards", f"data.path={shards}", "data.batch_size=2", "train.max_steps=9",
            "checkpoint.keep_last=5"]
    full = train(load_config(None, _keys(tmp_path / "full", "shards", *keys, "checkpoint.every_steps=4")))
    assert full["steps"] == 9 and len(train_windows) > 2 * 9  # step 4 is mid-epoch
    ckpt = tmp_path / "full" / "checkpoints" / layout.step_name(4)
    resumed = train(load_config(None, _keys(tmp_path / "resumed", "shards", *keys, f"resume={ckpt}")))
    assert resumed["params_sha256"] == full["params_sha256"]
    assert resumed["val_loss"] == full["val_loss"] and np.isfinite(full["val_loss"])
    assert resumed["val_count"] == full["val_count"] == len(pack_documents(byte_tokenizer().encode(TEXTS[:3]), SEQ))


def test_mfu_counts_the_real_tokens_only() -> None:
    ratios = []
    for real in (8, 6):  # the same steps of 8 positions, a quarter of them padding in the second run
        meter = Meter(global_batch=2, step=0, peak=Peak(1e9, "test"))
        meter.first_batch(nn.Linear(4, 4), Batch(torch.zeros(2, 4), torch.zeros(2), torch.arange(2)), tokens=real,
                          positions=8)
        meter.tokens_each_step = True
        for _ in range(3):
            meter.add_tokens(torch.tensor(real))
        row = meter.interval(3)
        assert row["tokens_per_s"] > 0 and meter.step_flops
        # mfu / tokens_per_s = the FLOPs of one real token / peak (the wall time cancels): padding's FLOPs
        # count nowhere, so a padded step's real token costs what an unpadded one does
        ratios.append(row["mfu"] / row["tokens_per_s"] * 1e9 * 8 / meter.step_flops)
    assert ratios == pytest.approx([1.0, 1.0], rel=1e-9)
