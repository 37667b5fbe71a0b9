"""Tokenizers and packed documents for causal-LM text (``data.packing=documents``, ``--packing documents``).

**Packing.** ``windows`` (the default, as before) cuts each document on its own into windows of
``seq_len + 1`` tokens and drops its short tail: no window spans two documents, and text shorter
than a window is never trained on. ``documents`` concatenates the documents (in their order) into
one stream and cuts that into windows of ``seq_len + 1`` tokens every ``seq_len`` tokens, as
GPT-style pretraining does, so no token is dropped: each window carries, per token, the index
of its document *within the window* (``doc_ids``: 0 for the window's first token, +1 at each
document start, so non-decreasing), and the last window of a split is padded (token 0,
:data:`PAD_DOC` as its doc id). What the model and the loss make of that is the causal-LM task's
(:mod:`hpctrain.tasks.causal_lm`): attention within a document only, no target across a
boundary or on padding.

**Tokenizers.** ``bytes`` (the default: a document's UTF-8 bytes, vocabulary 256), or a Hugging
Face tokenizer directory (``save_pretrained``; read offline, never downloaded). A document is
encoded with the tokenizer's own special tokens (a Llama tokenizer's BOS starts each document).
A tokenizer directory is data, never code:

* it is loaded with ``trust_remote_code=False`` and with stdin replaced by an empty stream, so
  no library can ask (and be answered) whether to run the folder's Python; a folder whose
  ``tokenizer_config.json`` or ``config.json`` has an ``auto_map`` (a tokenizer class in the
  folder's own code) is refused before any library sees it;
* every file in it must be a regular file (a FIFO, a device or a socket is refused, never
  opened), and every one but weights (``*.safetensors``, ``*.bin``, ...: a model folder's) at
  most :data:`MAX_TOKENIZER_FILE` bytes; ``tokenizer.json`` is read once through the bounded
  open and handed over as text;
* a pattern that gives up while encoding (a ``pre_tokenizer`` regex that backtracks
  catastrophically: Oniguruma's retry limit, which bounds each match's time, makes ``tokenizers``
  panic) is an error naming the tokenizer, not a Rust panic;
* its vocabulary is the largest id it can give plus one (not its count of entries: a
  vocabulary with holes, or with an id of 3,000,000,000, has more ids than entries), at most
  :data:`MAX_VOCAB`; token files are ``uint8``, ``uint16`` or ``uint32`` by that size, and an
  id a tokenizer gives outside its vocabulary is refused, named, never wrapped.
"""

from __future__ import annotations

import io
import json
import os
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hpctrain.core.errors import UserError
from hpctrain.core.safe_open import NotRegularError, TooLargeError, check_regular, read_regular
from hpctrain.data.errors import DataFormatError, MissingPackageError, ShardError
from hpctrain.data.pack import PackOptions, PackSource, Samples, npy_bytes, sample_key

PACKINGS = ("windows", "documents")
BYTES = "bytes"  # the byte-level tokenizer's name
BYTE_VOCAB = 256
MAX_VOCAB = 2**31  # ids 0 .. 2^31 - 1: what a text manifest may declare and an int32-indexed embedding holds
MAX_TOKENIZER_FILE = 2**30  # the largest published tokenizer.json files are tens of MB
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx", ".gguf")
CODE_CONFIGS = ("tokenizer_config.json", "config.json")  # where transformers looks for auto_map
TEXT_COLUMNS = ("text", "content", "document")  # a table's text column when none is named
PAD_DOC = -1  # the doc id of padding in stored windows (the task hands the model an id past every document)
_HINT = "hint: a directory written by tokenizer.save_pretrained(DIR), or bytes (byte-level, the default)"


@dataclass(frozen=True)
class Tokenizer:
    """Text to token ids: ``name`` (``bytes`` or the directory), ``vocab_size`` (largest id + 1), ``encode``."""

    name: str
    vocab_size: int
    encode_many: Callable[[list[str]], list[np.ndarray]]

    def encode(self, texts: Sequence[str | bytes]) -> list[np.ndarray]:
        """Each text's token ids (bytes are decoded as UTF-8 first where the tokenizer is not byte-level),
        each id checked against the vocabulary."""
        if self.name == BYTES:
            return [np.frombuffer(t if isinstance(t, bytes) else t.encode("utf-8"), dtype=np.uint8) for t in texts]
        decoded = [t.decode("utf-8", errors="replace") if isinstance(t, bytes) else t for t in texts]
        try:
            with _rust_panics_held():
                ids = self.encode_many(decoded)
        except BaseException as err:  # pyo3's PanicException derives from BaseException, not Exception
            if type(err).__name__ != "PanicException":
                raise
            raise DataFormatError(f"tokenizer {self.name} failed while encoding the text ({_one_line(err)}); hint: a "
                                  "pre_tokenizer or normalizer regex in its tokenizer.json that backtracks without "
                                  "end (nested quantifiers such as (a+)+): fix the pattern") from None
        return [self._checked(t, i) for i, t in enumerate(ids)]

    def _checked(self, ids: np.ndarray, text: int) -> np.ndarray:
        """``ids`` once each lies in ``[0, vocab_size)``: a token file of :attr:`dtype` holds it unchanged."""
        if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            bad = int(ids[(ids < 0) | (ids >= self.vocab_size)][0])
            raise DataFormatError(f"tokenizer {self.name} gave token id {bad} (text {text}), outside its vocabulary "
                                  f"[0, {self.vocab_size}); hint: a tokenizer whose ids all lie in its vocabulary "
                                  "(its tokenizer.json's model.vocab and added_tokens)")
        return ids

    @property
    def dtype(self) -> type[np.unsignedinteger[Any]]:
        """The smallest dtype that stores every token id (uint8 for bytes, as text shards always had)."""
        return np.uint8 if self.vocab_size <= 2**8 else np.uint16 if self.vocab_size <= 2**16 else np.uint32


def byte_tokenizer() -> Tokenizer:
    return Tokenizer(BYTES, BYTE_VOCAB, lambda texts: [np.frombuffer(t.encode(), np.uint8) for t in texts])


def load_tokenizer(spec: str | None, key: str = "data.tokenizer") -> Tokenizer:
    """``None`` / ``bytes``: byte-level; else a Hugging Face tokenizer directory, loaded offline, as
    data only (the module doc)."""
    if spec in (None, BYTES):
        return byte_tokenizer()
    path = Path(str(spec)).expanduser()
    where = f"{key}={spec}"
    if not path.is_dir():
        raise DataFormatError(f"{where}: no such directory; hint: a Hugging Face tokenizer saved with "
                              "tokenizer.save_pretrained(DIR) (tokenizer.json), or bytes (byte-level, the default)")
    check_tokenizer_dir(path, where)
    try:
        with _no_stdin():
            if (path / "tokenizer.json").is_file():  # a fast tokenizer: its own library reads it (no transformers)
                return _fast_tokenizer(path, where)
            return _transformers_tokenizer(path, where)
    except ImportError as err:
        raise MissingPackageError(f"{where} needs {err.name or 'transformers'}, which is not installed; "
                                  "hint: pip install transformers") from None
    except UserError:
        raise
    except Exception as err:  # noqa: BLE001 - tokenizers raises a bare Exception for a bad tokenizer.json
        raise DataFormatError(f"{where} cannot be loaded as a Hugging Face tokenizer ({type(err).__name__}: "
                              f"{_one_line(err)}); {_HINT}") from None


def check_tokenizer_dir(path: Path, where: str) -> None:
    """Every file of a tokenizer directory regular and bounded, and no ``auto_map`` (code) in its configs."""
    for entry in sorted(path.iterdir()):
        if entry.is_dir():
            continue  # transformers reads a tokenizer's files from the directory itself
        limit = None if entry.name.endswith(WEIGHT_SUFFIXES) else MAX_TOKENIZER_FILE
        try:
            check_regular(entry, limit=limit)
        except NotRegularError as err:
            raise DataFormatError(f"{where}: {entry} is a {err.kind}, not a regular file; {_HINT}") from None
        except TooLargeError as err:
            raise DataFormatError(f"{where}: {entry} holds {err.size:,} bytes, more than the {err.limit:,} a tokenizer "
                                  f"file may hold (MAX_TOKENIZER_FILE); {_HINT}") from None
        except OSError as err:
            raise DataFormatError(f"{where}: {entry} cannot be read ({err.strerror}); {_HINT}") from None
    for name in CODE_CONFIGS:
        if (path / name).is_file() and "auto_map" in _json_object(path / name, where):
            raise DataFormatError(f"{where}: {path / name} has an auto_map: the tokenizer is the folder's own Python "
                                  "code, which hpctrain never runs (trust_remote_code=False); hint: save a tokenizer "
                                  "that needs no code (tokenizer.json, e.g. PreTrainedTokenizerFast.save_pretrained)")


def _json_object(path: Path, where: str) -> dict[str, Any]:
    try:
        value = json.loads(read_regular(path, limit=MAX_TOKENIZER_FILE))
    except (ValueError, RecursionError) as err:  # bad JSON or UTF-8, deep nesting
        raise DataFormatError(f"{where}: {path} is not valid JSON ({_one_line(err)[:200]}); {_HINT}") from None
    if not isinstance(value, dict):
        raise DataFormatError(f"{where}: {path} holds {type(value).__name__}, not a JSON object; {_HINT}")
    return value


def _fast_tokenizer(path: Path, where: str) -> Tokenizer:
    """``tokenizer.json`` as ``tokenizers`` reads it (its bytes read here, bounded); its post-processor
    adds the special tokens (BOS, ...) as ``transformers`` would; the vocabulary counts the added tokens."""
    import tokenizers  # optional: only a tokenizer directory needs it

    text = read_regular(path / "tokenizer.json", limit=MAX_TOKENIZER_FILE).decode("utf-8")
    tok = tokenizers.Tokenizer.from_str(text)

    def encode_many(texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(e.ids, dtype=np.int64) for e in tok.encode_batch(texts, add_special_tokens=True)]
    vocab = tok.get_vocab(with_added_tokens=True)
    return Tokenizer(str(path), _vocab_size(where, vocab, tok.get_vocab_size(with_added_tokens=True)), encode_many)


def _transformers_tokenizer(path: Path, where: str) -> Tokenizer:
    """Any other tokenizer directory (a sentencepiece model, ...), by ``transformers``, offline, no code."""
    import transformers  # optional: only a tokenizer directory without tokenizer.json needs it

    tok = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)

    def encode_many(texts: list[str]) -> list[np.ndarray]:
        ids = tok(texts, add_special_tokens=True)["input_ids"] if texts else []
        return [np.asarray(i, dtype=np.int64) for i in ids]
    return Tokenizer(str(path), _vocab_size(where, tok.get_vocab(), len(tok)), encode_many)


def _vocab_size(where: str, vocab: dict[str, int], count: int) -> int:
    """The largest id + 1 (at least the entry count), refused above :data:`MAX_VOCAB`."""
    token, top = max(vocab.items(), key=lambda kv: kv[1], default=("", -1))
    if top >= MAX_VOCAB:
        raise DataFormatError(f"{where}: token {token!r} has id {top:,}, beyond the {MAX_VOCAB - 1:,} that token files "
                              "and models hold; hint: renumber the vocabulary from 0 (ids 0..N-1)")
    if min(vocab.values(), default=0) < 0:
        low = min(vocab.items(), key=lambda kv: kv[1])
        raise DataFormatError(f"{where}: token {low[0]!r} has id {low[1]}, below 0; hint: renumber the vocabulary "
                              "from 0 (ids 0..N-1)")
    return max(count, top + 1)


@contextmanager
def _no_stdin() -> Iterator[None]:
    """stdin as an empty stream while a library loads a tokenizer: a prompt (``input()``) reads
    end-of-file, never the user's terminal or a pipe that would answer it."""
    saved, sys.stdin = sys.stdin, io.StringIO("")
    try:
        yield
    finally:
        sys.stdin = saved


@contextmanager
def _rust_panics_held() -> Iterator[None]:
    """fd 2 into a temporary file while Rust code encodes: a panic's hook prints its message and
    backtrace there (the exception carries the message, the error names it in one line);
    anything else written meanwhile is passed on to stderr afterwards."""
    sys.stderr.flush()
    saved = os.dup(2)
    panicked = False
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        except BaseException as err:
            panicked = type(err).__name__ == "PanicException"
            raise
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            if not panicked and held.tell():
                held.seek(0)
                os.write(2, held.read(1 << 20))


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())


def check_packing(packing: str, key: str = "data.packing") -> None:
    if packing not in PACKINGS:
        raise DataFormatError(f"{key}={packing!r} is not one of {', '.join(PACKINGS)}; hint: documents packs "
                              "documents into windows with their boundaries kept, windows cuts each on its own")


# ---------------------------------------------------------------- windows of one document, and packed documents


def windows(tokens: np.ndarray, seq_len: int) -> np.ndarray:
    """``(n, seq_len + 1)`` token windows every ``seq_len`` tokens of one document, a view of
    ``tokens`` (no copy of a large document); the short tail is dropped."""
    n = max(0, (len(tokens) - 1) // seq_len)
    if not n:
        return tokens[:0].reshape(0, seq_len + 1)
    return np.lib.stride_tricks.sliding_window_view(tokens, seq_len + 1)[::seq_len][:n]


@dataclass(frozen=True)
class Packed:
    """Windows of packed documents: ``tokens`` ``(n, seq_len + 1)`` (a view of the padded stream),
    ``starts`` the stream offset of each document, ``real`` the stream's tokens before padding.
    Per-token document ids are derived on demand (:meth:`bounds` for one window,
    :attr:`doc_ids` for all), so packing holds no per-token array beyond the tokens."""

    tokens: np.ndarray
    starts: np.ndarray
    real: int

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def seq_len(self) -> int:
        return int(self.tokens.shape[1]) - 1

    def bounds(self, i: int) -> np.ndarray:
        """Window ``i``'s ``doc.npy`` (:func:`doc_bounds` of its doc ids): 0, the other documents'
        starts within it, its count of real tokens."""
        lo = i * self.seq_len
        end = min(lo + self.seq_len + 1, self.real)
        inside = self.starts[np.searchsorted(self.starts, lo, "right"):np.searchsorted(self.starts, end, "left")]
        return np.concatenate([[0], inside - lo, [end - lo]]).astype(np.int32)

    @property
    def doc_ids(self) -> np.ndarray:
        """``(n, seq_len + 1)`` int32: each token's document within its window, :data:`PAD_DOC` on padding."""
        pos = np.arange(len(self), dtype=np.int64)[:, None] * self.seq_len + np.arange(self.seq_len + 1)
        doc = np.searchsorted(self.starts, pos, "right") - 1
        return np.where(pos < self.real, doc - doc[:, :1], PAD_DOC).astype(np.int32)


def pack_documents(docs: Sequence[np.ndarray], seq_len: int, dtype: Any = None) -> Packed:
    """The documents concatenated and cut into windows of ``seq_len + 1`` every ``seq_len`` tokens
    (so every token but the first is a target exactly once); the last window padded. Empty
    documents hold no token and are skipped. Memory: the stream once, in ``dtype``."""
    docs = [d for d in docs if len(d)]  # consecutive indices: an empty document would leave a gap
    lengths = np.array([len(d) for d in docs], dtype=np.int64)
    real = int(lengths.sum())
    n = -(-(real - 1) // seq_len) if real > 1 else 0
    found = np.result_type(*{d.dtype for d in docs}) if docs else np.dtype(np.int64)
    kind = np.dtype(dtype) if dtype is not None else found
    stream = np.zeros(n * seq_len + 1 if n else 0, kind)  # its tail past the documents is the padding (token 0)
    if n:
        np.concatenate(docs, out=stream[:real], casting="unsafe")  # ids checked against the dtype by the tokenizer
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) if docs else np.zeros(0, np.int64)
    return Packed(windows(stream, seq_len) if n else stream.reshape(0, seq_len + 1), starts, real)


def doc_bounds(doc_ids: np.ndarray) -> np.ndarray:
    """One window's ``doc_ids`` as stored in a shard (``doc.npy``): the positions where each of its
    documents starts (0 first), then the count of real tokens (the window's length without padding)."""
    real = int((doc_ids != PAD_DOC).sum())
    starts = np.flatnonzero(np.diff(doc_ids[:real], prepend=-2) != 0)
    return np.append(starts, real).astype(np.int32)


def doc_ids_of(bounds: np.ndarray, length: int) -> np.ndarray:
    """The inverse of :func:`doc_bounds`: a window's int32 ``doc_ids`` of ``length`` tokens."""
    starts, real = bounds[:-1], int(bounds[-1])
    ids = np.full(length, PAD_DOC, dtype=np.int32)
    ids[:real] = np.searchsorted(starts, np.arange(real), side="right") - 1
    return ids


# ---------------------------------------------------------------- as shard samples; tables' text columns


@dataclass(frozen=True)
class Fields:
    """``count`` windows' shard fields, each made when written (``at(i)``): no list of millions of dicts."""

    count: int
    at: Callable[[int], dict[str, np.ndarray]]

    def __len__(self) -> int:
        return self.count


def packed_fields(packed: Packed) -> Fields:
    """Each packed window's shard fields: its tokens (``npy``), its document starts and real length (``doc.npy``)."""
    return Fields(len(packed), lambda i: {"npy": packed.tokens[i], "doc.npy": packed.bounds(i)})


def window_fields(per_doc: Sequence[np.ndarray]) -> Fields:
    """The windows of each document in turn (``npy``), as fields."""
    ends = np.cumsum([len(w) for w in per_doc], dtype=np.int64)

    def at(i: int) -> dict[str, np.ndarray]:
        doc = int(np.searchsorted(ends, i, "right"))
        return {"npy": per_doc[doc][i - (int(ends[doc - 1]) if doc else 0)]}
    return Fields(int(ends[-1]) if len(ends) else 0, at)


def window_samples(fields: Fields, split: str) -> Samples:
    """The windows as shard samples, in a fixed shuffled order (seed 0) so no shard holds one document."""
    order = np.random.default_rng(0).permutation(len(fields))
    for i, row in enumerate(order):
        yield sample_key(split, i), {ext: npy_bytes(a) for ext, a in fields.at(int(row)).items()}


def table_texts(table: Any, name: str, key: str | None, setting: str = "data.input_key") -> tuple[list[str], str]:
    """A table's text column (``key``, else the first of :data:`TEXT_COLUMNS`) and its name; a
    missing column or a row that is not text is refused, named."""
    columns = list(table.column_names)
    column = key or next((c for c in TEXT_COLUMNS if c in columns), None)
    if column is None or column not in columns:
        raise DataFormatError(f"{name} has no text column {key or ' / '.join(TEXT_COLUMNS)!r}; its columns are "
                              f"{columns}; hint: {setting}=COLUMN names the text")
    texts = _column_texts(table.column(column), name, column)
    bad = next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)
    if bad is not None:
        raise DataFormatError(f"{name}: column {column!r} row {bad} holds {type(texts[bad]).__name__}, not text; "
                              f"hint: {setting}=COLUMN names the text column")
    return texts, column


def _column_texts(values: Any, name: str, column: str) -> list[Any]:
    """A column's values as Python objects; a value that is not UTF-8 (pyarrow reads such bytes
    unchecked into a string column) is refused naming its row, not raised as UnicodeDecodeError."""
    try:
        return list(values.to_pylist())
    except UnicodeDecodeError:
        for row, value in enumerate(values):  # the error path only: find the row
            try:
                value.as_py()
            except UnicodeDecodeError as err:
                raise DataFormatError(f"{name}: column {column!r} row {row} is not UTF-8 text ({err.reason}, byte "
                                      f"{err.start} of the value); hint: write the file as UTF-8 (e.g. iconv -f "
                                      "latin1 -t utf-8)") from None
        raise


def table_documents_pack(table: Any, name: str, split: str, options: PackOptions, source: str) -> PackSource:
    """``hpctrain data shard jsonl:|parquet:|csv:|hf:PATH --packing documents``: each row's text
    (``--input-column``, else the first of :data:`TEXT_COLUMNS`) a document, packed into shards."""
    tok = load_tokenizer(options.tokenizer, "--tokenizer")
    key = options.input_columns[0] if options.input_columns else None
    texts, column = table_texts(table, name, key, "--input-column")
    ids = tok.encode(texts)
    packed = pack_documents(ids, options.seq_len, tok.dtype)
    if not len(packed):
        raise ShardError(f"{name}: column {column!r} holds fewer than 2 tokens in all; hint: more text")
    meta = {"source": source, "task": "causal_lm", "tokenizer": tok.name, "vocab_size": tok.vocab_size,
            "seq_len": options.seq_len, "packing": "documents", "classes": [], "text_column": column,
            "decode": {"input": "npy", "target": None}, "documents": len(texts), "tokens": int(sum(map(len, ids)))}
    return PackSource(window_samples(packed_fields(packed), split), len(packed), meta)
