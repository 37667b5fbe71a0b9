"""What a tokenizer folder and a text corpus can do to hpctrain (issue 42): nothing but be read.

A tokenizer folder never runs code and never reads stdin (``auto_map`` refused,
``trust_remote_code=False``), its files are opened bounded and regular-only, a regex that gives up
is an error, ids are checked against the token files' dtype; a jsonl line that is not UTF-8 or
a document over the documented limit is a one-line error naming file and line.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hpctrain.cli import main
from hpctrain.data import packed
from hpctrain.data.errors import DataFormatError, ShardError
from hpctrain.data.files import jsonl_source
from hpctrain.data.pack import DOCUMENT_LIMIT_ENV, MAX_DOCUMENT_BYTES, PackOptions
from hpctrain.data.packed import MAX_VOCAB, Tokenizer, doc_bounds, load_tokenizer, pack_documents
from hpctrain.data.tables import jsonl_pack
from hpctrain.data.text import read_documents, text_source

REPO = Path(__file__).resolve().parents[2]


def _word_level(root: Path, vocab: dict[str, int], pre: Any = None) -> Path:
    """A word-level tokenizer.json (built here, never downloaded)."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import models, pre_tokenizers

    root.mkdir(parents=True, exist_ok=True)
    tok = RustTokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre or pre_tokenizers.Whitespace()
    tok.save(str(root / "tokenizer.json"))
    saved = json.loads((root / "tokenizer.json").read_text())  # the ids as given: tokenizers saves a vocabulary
    saved["model"]["vocab"] = vocab  # with an id of 2^31 - 1 in 44 s, and reads it back at once
    (root / "tokenizer.json").write_text(json.dumps(saved))
    return root


def _code_folder(root: Path, config: str = "tokenizer_config.json") -> Path:
    """A folder whose tokenizer is its own Python: importing it writes MARKER."""
    _word_level(root, {"[UNK]": 0, "a": 1})
    (root / "tokenizer.json").rename(root / "tok.json")  # no tokenizer.json: transformers would load it
    (root / "tokenization_evil.py").write_text(
        f"open({str(root / 'MARKER')!r}, 'w').write('ran')\n"
        "from transformers import PreTrainedTokenizerFast\n"
        "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    (root / config).write_text(json.dumps({"tokenizer_class": "EvilTokenizer", "tokenizer_file": str(root / "tok.json"),
                                           "auto_map": {"AutoTokenizer": [None, "tokenization_evil.EvilTokenizer"]}}))
    return root


# ---------------------------------------------------------------- code: refused, stdin never read


def test_a_folder_with_auto_map_is_refused_and_stdin_that_answers_y_is_never_read(tmp_path: Path) -> None:
    folder = _code_folder(tmp_path / "tok")
    (tmp_path / "doc.txt").write_text("a a a a a a a a a a\n")
    run = subprocess.run([sys.executable, "-m", "hpctrain", "data", "shard", f"text:{tmp_path / 'doc.txt'}",
                          str(tmp_path / "out"), "--tokenizer", str(folder), "--split", "train", "--quiet"],
                         input="y\ny\n", capture_output=True, text=True, timeout=120, cwd=REPO)
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines() == [
        f"hpctrain data shard: error: --tokenizer={folder}: {folder / 'tokenizer_config.json'} has an auto_map: the "
        "tokenizer is the folder's own Python code, which hpctrain never runs (trust_remote_code=False); hint: save "
        "a tokenizer that needs no code (tokenizer.json, e.g. PreTrainedTokenizerFast.save_pretrained)"]
    assert "[y/N]" not in run.stdout + run.stderr
    assert not (folder / "MARKER").exists() and not (tmp_path / "out").exists()


def test_auto_map_in_config_json_is_refused_and_transformers_is_asked_with_trust_remote_code_false(
        tmp_path: Path, monkeypatch) -> None:
    in_config = _code_folder(tmp_path / "cfg", "config.json")
    with pytest.raises(DataFormatError, match=r"config\.json has an auto_map"):
        load_tokenizer(str(in_config))
    # below the check: transformers itself refuses (trust_remote_code=False), and no prompt reads stdin
    pytest.importorskip("transformers")
    folder = _code_folder(tmp_path / "tok")
    answer = io.StringIO("y\n")
    monkeypatch.setattr(sys, "stdin", answer)
    with pytest.raises(ValueError, match="contains custom code"):
        packed._transformers_tokenizer(folder, "x")
    assert not (folder / "MARKER").exists() and answer.read() == "y\n"


# ---------------------------------------------------------------- files: regular and bounded


@pytest.mark.timeout(60)  # a FIFO opened, or /dev/zero read, would hang here
@pytest.mark.parametrize("kind", ["fifo", "zero"])
def test_a_fifo_or_dev_zero_in_a_tokenizer_folder_is_refused_unopened(tmp_path: Path, kind: str) -> None:
    folder = tmp_path / "tok"
    folder.mkdir()
    if kind == "fifo":
        os.mkfifo(folder / "tokenizer.json")
    else:
        (folder / "tokenizer.model").symlink_to("/dev/zero")
    name, what = ("tokenizer.json", "FIFO") if kind == "fifo" else ("tokenizer.model", "character device")
    with pytest.raises(DataFormatError) as err:
        load_tokenizer(str(folder), "--tokenizer")
    assert str(err.value) == (f"--tokenizer={folder}: {folder / name} is a {what}, not a regular file; hint: a "
                              "directory written by tokenizer.save_pretrained(DIR), or bytes (byte-level, the default)")


def test_an_oversized_tokenizer_file_is_refused_naming_the_limit(tmp_path: Path, monkeypatch) -> None:
    folder = _word_level(tmp_path / "tok", {"[UNK]": 0, "a": 1})
    (folder / "model.safetensors").write_bytes(b"\0" * 64)  # weights beside it: not a tokenizer file, not limited
    monkeypatch.setattr(packed, "MAX_TOKENIZER_FILE", 32)
    with pytest.raises(DataFormatError, match=r"tokenizer\.json holds [\d,]+ bytes, more than the 32 a tokenizer "
                                              "file may hold"):
        load_tokenizer(str(folder))


def test_a_regex_that_gives_up_is_a_one_line_error_not_a_rust_panic(tmp_path: Path, capfd) -> None:
    from tokenizers import Regex, pre_tokenizers

    folder = _word_level(tmp_path / "tok", {"[UNK]": 0, "a": 1}, pre_tokenizers.Split(Regex("(a+)+$"), "isolated"))
    tok = load_tokenizer(str(folder))
    assert [t.tolist() for t in tok.encode(["b a"])] == [[0, 1]]  # the tokenizer works on kind text
    with pytest.raises(DataFormatError) as err:
        tok.encode(["a" * 40 + "!"])
    assert str(err.value).startswith(f"tokenizer {folder} failed while encoding the text (Onig: Regex search "
                                     "error: retry-limit-in-match over); hint: a pre_tokenizer")
    assert "panicked" not in capfd.readouterr().err  # the Rust hook's lines were held back


# ---------------------------------------------------------------- ids against the token files' dtype


def test_the_vocabulary_is_the_largest_id_and_the_dtype_holds_every_id(tmp_path: Path) -> None:
    cases = {300: (301, np.uint16), 70_000: (70_001, np.uint32), 2**31 - 1: (MAX_VOCAB, np.uint32)}
    for top, (vocab, dtype) in cases.items():
        tok = load_tokenizer(str(_word_level(tmp_path / str(top), {"[UNK]": 0, "a": 1, "b": top})))
        assert (tok.vocab_size, tok.dtype) == (vocab, dtype)  # not 3 entries: uint8 would wrap b to 44
    (tmp_path / "doc.txt").write_text("a b " * 40)
    source = text_source(tmp_path / "doc.txt", "train", 8, tokenizer=str(tmp_path / "70000"))
    window = np.load(io.BytesIO(next(source.samples)[1]["npy"]))
    assert window.dtype == np.uint32 and set(window.tolist()) == {1, 70_000}
    assert source.meta["vocab_size"] == 70_001


def test_an_id_beyond_the_largest_vocabulary_or_outside_it_is_refused_named(tmp_path: Path) -> None:
    folder = _word_level(tmp_path / "tok", {"[UNK]": 0, "a": 1, "b": 3_000_000_000})
    with pytest.raises(DataFormatError) as err:
        load_tokenizer(str(folder), "--tokenizer")
    assert str(err.value) == (f"--tokenizer={folder}: token 'b' has id 3,000,000,000, beyond the 2,147,483,647 that "
                              "token files and models hold; hint: renumber the vocabulary from 0 (ids 0..N-1)")
    liar = Tokenizer("liar", 256, lambda texts: [np.array([5, 300, 7]) for _ in texts])  # says 256, gives 300
    with pytest.raises(DataFormatError, match=r"^tokenizer liar gave token id 300 \(text 0\), outside its "
                                              r"vocabulary \[0, 256\)"):
        liar.encode(["x"])


# ---------------------------------------------------------------- text: UTF-8 by line, bounded documents


def test_non_utf8_in_a_jsonl_record_names_the_file_and_line(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"text": "fine"}\n\n{"text": "caf\xe9 latin-1"}\n')
    expect = f"{bad} line 3 is not UTF-8 text (invalid continuation byte, byte 14 of the line)"
    for extra in ([], ["--packing", "documents"]):  # records as .json; the text column packed (pyarrow)
        assert main(["data", "shard", f"jsonl:{bad}", str(tmp_path / "out"), "--quiet", *extra]) == 2
        err = capsys.readouterr().err
        assert expect in err and len(err.strip().splitlines()) == 1
    pa = pytest.importorskip("pyarrow")  # a string column with bad bytes from any reader: the row named
    table = pa.table({"text": pa.array([b"ok", b"\xff"], pa.binary()).view(pa.string())})
    with pytest.raises(DataFormatError, match=r"^t: column 'text' row 1 is not UTF-8 text"):
        packed.table_texts(table, "t", None)


def test_a_line_or_document_over_the_limit_is_refused_before_it_is_read(tmp_path: Path, monkeypatch) -> None:
    huge = tmp_path / "huge.txt"
    with huge.open("wb") as fh:  # sparse: 500 MB of NUL bytes that take no disk (and are no tar)
        fh.truncate(500 << 20)
    with pytest.raises(ShardError) as err:
        read_documents(huge)
    assert str(err.value) == (f"text document {huge} holds 524,288,000 bytes, more than the {MAX_DOCUMENT_BYTES:,} "
                              "one document may hold (it is read and tokenized at once); hint: split it into several "
                              f"documents (files, lines), or raise the limit: {DOCUMENT_LIMIT_ENV}=1GB")
    monkeypatch.setenv(DOCUMENT_LIMIT_ENV, "64")
    lines = tmp_path / "t.jsonl"
    lines.write_text(json.dumps({"text": "short"}) + "\n" + json.dumps({"text": "x" * 100}) + "\n")
    for read in (jsonl_source, jsonl_pack):
        with pytest.raises(ShardError, match=rf"^{lines} line 2 holds more than the 64 bytes one document may hold"):
            read(str(lines), "train", PackOptions(packing="documents"))
    archive = tmp_path / "c.tar"
    (tmp_path / "long.txt").write_text("y" * 100)
    with tarfile.open(archive, "w") as tf:
        tf.add(tmp_path / "long.txt", arcname="long.txt")
    with pytest.raises(ShardError, match=rf"^{archive} member long.txt holds 100 bytes, more than the 64"):
        read_documents(archive)
    monkeypatch.setenv(DOCUMENT_LIMIT_ENV, "1KB")  # the shard writer's sizes; a long jsonl line pyarrow reads whole
    long_line = tmp_path / "long.jsonl"
    long_line.write_text(json.dumps({"text": "z" * 900}) + "\n")
    assert jsonl_pack(str(long_line), "train", PackOptions(packing="documents", seq_len=8)).size == 113


def test_packed_windows_bound_their_documents_lazily_and_exactly() -> None:
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 9, n) for n in (5, 0, 1, 17, 3, 30, 2)]
    packing = pack_documents(docs, 6, np.uint8)
    assert packing.tokens.dtype == np.uint8 and packing.real == 58
    for i in range(len(packing)):
        np.testing.assert_array_equal(packing.bounds(i), doc_bounds(packing.doc_ids[i]))


@pytest.mark.timeout(60)  # an open FIFO, or /dev/zero read to the end, would hang here
def test_a_fifo_or_a_device_as_a_text_document_is_refused_unopened(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "doc.txt")
    with pytest.raises(ShardError, match=rf"^text document {tmp_path / 'doc.txt'} is a FIFO, not a regular file"):
        read_documents(tmp_path / "doc.txt")
    with pytest.raises(ShardError, match=r"^text document /dev/zero is a character device, not a regular file"):
        read_documents("/dev/zero")
