"""A single-document text source gets a validation split: its tokens' tail (issue 43, point 3).

nanoGPT splits its one ``input.txt`` 90/10 by position; ``text:FILE`` now does the same by
tokens (``--val-fraction``, default 0.1), where it had no val split at all ("no val window of 65
tokens in 0 documents; hint: a shorter --seq-len"). Corpora of several documents keep their
split by document.
"""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import numpy as np
import pytest

from hpctrain.cli import main
from hpctrain.data.errors import ShardError
from hpctrain.data.text import tail_cut, text_source

SEQ = 16


def _tokens(source_samples) -> list[np.ndarray]:
    return [np.load(io.BytesIO(fields["npy"])) for _, fields in source_samples]


def _text(path: Path, n: int = 1000) -> bytes:
    data = bytes(np.random.default_rng(3).integers(32, 127, n, dtype=np.uint8))
    path.write_bytes(data)
    return data


def _covered(windows: list[np.ndarray], data: bytes) -> set[int]:
    """The positions in ``data`` that the windows hold (each window found by its bytes: random text)."""
    where: set[int] = set()
    for w in windows:
        at = data.find(w.tobytes())
        assert at >= 0 and data.find(w.tobytes(), at + 1) < 0
        where.update(range(at, at + len(w)))
    return where


def test_one_file_holds_out_its_last_tenth_of_tokens_as_val(tmp_path: Path) -> None:
    data = _text(tmp_path / "input.txt")
    cut = tail_cut(len(data), 0.1)
    assert cut == 900  # round(1000 * 0.1) tokens of val, as nanoGPT's int(n * 0.9) train
    train, val = (text_source(tmp_path / "input.txt", s, SEQ) for s in ("train", "val"))
    train_w, val_w = _tokens(train.samples), _tokens(val.samples)
    assert (len(train_w), len(val_w)) == ((cut - 1) // SEQ, (len(data) - cut - 1) // SEQ) == (56, 6)
    assert max(_covered(train_w, data)) < cut <= min(_covered(val_w, data))  # no window spans the cut
    assert val.meta["documents"] == [{"name": "input.txt", "bytes": 1000, "tokens": 100, "samples": 6,
                                      "token_range": [900, 1000]}]
    assert train.meta["documents"][0]["token_range"] == [0, 900]
    assert val.meta["split_rule"] == "one document: its last 0.1 of tokens val, the rest train"
    again = text_source(tmp_path / "input.txt", "val", SEQ)  # deterministic
    assert [w.tolist() for w in _tokens(again.samples)] == [w.tolist() for w in val_w]


def test_the_cli_writes_both_splits_of_one_file_and_split_s_keeps_all_of_it(tmp_path: Path, capsys) -> None:
    data = _text(tmp_path / "input.txt")
    assert main(["data", "shard", f"text:{tmp_path / 'input.txt'}", str(tmp_path / "out"), "--seq-len", str(SEQ),
                 "--val-fraction", "0.2", "--quiet"]) == 0
    counts = {s: json.loads((tmp_path / "out" / f"{s}.manifest.json").read_text())["total_samples"]
              for s in ("train", "val")}
    assert counts == {"train": (800 - 1) // SEQ, "val": (200 - 1) // SEQ}
    # --split train without --val-fraction: the whole file is train, as before
    assert main(["data", "shard", f"text:{tmp_path / 'input.txt'}", str(tmp_path / "all"), "--seq-len", str(SEQ),
                 "--split", "train", "--quiet"]) == 0
    whole = json.loads((tmp_path / "all" / "train.manifest.json").read_text())
    assert whole["total_samples"] == (len(data) - 1) // SEQ and "token_range" not in whole["documents"][0]


def test_a_tail_too_short_for_a_window_points_at_the_val_fraction(tmp_path: Path) -> None:
    _text(tmp_path / "input.txt", 100)  # val: 10 tokens, a window needs 17
    with pytest.raises(ShardError) as err:
        text_source(tmp_path / "input.txt", "val", SEQ)
    assert str(err.value) == (f"text source {tmp_path / 'input.txt'}: the val share of its one document holds 10 "
                              "tokens, fewer than a window of 17 (one document: its last 0.1 of tokens val, the "
                              "rest train); hint: a larger --val-fraction, a shorter --seq-len, or more text")


def test_several_documents_still_split_by_document(tmp_path: Path) -> None:
    corpus = tmp_path / "c"
    corpus.mkdir()
    for i in range(3):
        _text(corpus / f"d{i}.txt", 200 + i)
    ranked = sorted((f"d{i}.txt" for i in range(3)), key=lambda n: hashlib.sha256(n.encode()).hexdigest())
    val = text_source(corpus, "val", SEQ, val_fraction=0.3)
    train = text_source(corpus, "train", SEQ, val_fraction=0.3)
    assert [d["name"] for d in val.meta["documents"]] == [ranked[0]]  # round(3 * 0.3) = 1 whole document
    assert sorted(d["name"] for d in train.meta["documents"]) == sorted(ranked[1:])
    assert all("token_range" not in d for d in val.meta["documents"] + train.meta["documents"])
    # a folder of one document is one document: its tail is val
    (single := tmp_path / "one").mkdir()
    _text(single / "only.txt")
    assert text_source(single, "val", SEQ).meta["documents"][0]["token_range"] == [900, 1000]
