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
Face tokenizer directory (``save_pretrained``; read offline, never downloaded), whose
``len(tokenizer)`` (base vocabulary plus added tokens) is the data's vocabulary. A document is
encoded with the tokenizer's own special tokens (a Llama tokenizer's BOS starts each document).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hpctrain.data.errors import DataFormatError, MissingPackageError, ShardError
from hpctrain.data.pack import PackOptions, PackSource, Samples, npy_bytes, sample_key

PACKINGS = ("windows", "documents")
BYTES = "bytes"  # the byte-level tokenizer's name
BYTE_VOCAB = 256
TEXT_COLUMNS = ("text", "content", "document")  # a table's text column when none is named
PAD_DOC = -1  # the doc id of padding in stored windows (the task hands the model an id past every document)


@dataclass(frozen=True)
class Tokenizer:
    """Text to token ids: ``name`` (``bytes`` or the directory), ``vocab_size``, ``encode``."""

    name: str
    vocab_size: int
    encode_many: Callable[[list[str]], list[np.ndarray]]

    def encode(self, texts: Sequence[str | bytes]) -> list[np.ndarray]:
        """Each text's token ids (bytes are decoded as UTF-8 first where the tokenizer is not byte-level)."""
        if self.name == BYTES:
            return [np.frombuffer(t if isinstance(t, bytes) else t.encode("utf-8"), dtype=np.uint8) for t in texts]
        return self.encode_many([t.decode("utf-8", errors="replace") if isinstance(t, bytes) else t for t in texts])

    @property
    def dtype(self) -> type[np.unsignedinteger[Any]] | type[np.int32]:
        """The smallest dtype that stores every token id (uint8 for bytes, as text shards always had)."""
        return np.uint8 if self.vocab_size <= 2**8 else np.uint16 if self.vocab_size <= 2**16 else np.int32


def byte_tokenizer() -> Tokenizer:
    return Tokenizer(BYTES, BYTE_VOCAB, lambda texts: [np.frombuffer(t.encode(), np.uint8) for t in texts])


def load_tokenizer(spec: str | None, key: str = "data.tokenizer") -> Tokenizer:
    """``None`` / ``bytes``: byte-level; else a Hugging Face tokenizer directory, loaded offline."""
    if spec in (None, BYTES):
        return byte_tokenizer()
    path = Path(str(spec)).expanduser()
    if not path.is_dir():
        raise DataFormatError(f"{key}={spec}: no such directory; hint: a Hugging Face tokenizer saved with "
                              "tokenizer.save_pretrained(DIR) (tokenizer.json), or bytes (byte-level, the default)")
    try:
        if (path / "tokenizer.json").is_file():  # a fast tokenizer: its own library reads it (no transformers import)
            return _fast_tokenizer(path)
        return _transformers_tokenizer(path)
    except ImportError as err:
        raise MissingPackageError(f"{key}={spec} needs {err.name or 'transformers'}, which is not installed; "
                                  "hint: pip install transformers") from None
    except Exception as err:  # noqa: BLE001 - tokenizers raises a bare Exception for a bad tokenizer.json
        raise DataFormatError(f"{key}={spec} cannot be loaded as a Hugging Face tokenizer ({type(err).__name__}: "
                              f"{err}); hint: a directory written by tokenizer.save_pretrained(DIR)") from None


def _fast_tokenizer(path: Path) -> Tokenizer:
    """``tokenizer.json`` as ``tokenizers`` reads it; its post-processor adds the special tokens
    (BOS, ...) as ``transformers`` would; the vocabulary counts the added tokens."""
    import tokenizers  # optional: only a tokenizer directory needs it

    tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))

    def encode_many(texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(e.ids, dtype=np.int64) for e in tok.encode_batch(texts, add_special_tokens=True)]
    return Tokenizer(str(path), tok.get_vocab_size(with_added_tokens=True), encode_many)


def _transformers_tokenizer(path: Path) -> Tokenizer:
    """Any other tokenizer directory (a sentencepiece model, ...), by ``transformers``, offline."""
    import transformers  # optional: only a tokenizer directory without tokenizer.json needs it

    tok = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)

    def encode_many(texts: list[str]) -> list[np.ndarray]:
        ids = tok(texts, add_special_tokens=True)["input_ids"] if texts else []
        return [np.asarray(i, dtype=np.int64) for i in ids]
    return Tokenizer(str(path), len(tok), encode_many)


def check_packing(packing: str, key: str = "data.packing") -> None:
    if packing not in PACKINGS:
        raise DataFormatError(f"{key}={packing!r} is not one of {', '.join(PACKINGS)}; hint: documents packs "
                              "documents into windows with their boundaries kept, windows cuts each on its own")


# ---------------------------------------------------------------- windows of one document, and packed documents


def windows(tokens: np.ndarray, seq_len: int) -> np.ndarray:
    """``(n, seq_len + 1)`` token windows every ``seq_len`` tokens of one document; the short tail is dropped."""
    n = max(0, (len(tokens) - 1) // seq_len)
    return tokens[np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)]


@dataclass(frozen=True)
class Packed:
    """Windows of packed documents: ``tokens`` and ``doc_ids`` both ``(n, seq_len + 1)``; ``doc_ids``
    int32, the document's index within its window, :data:`PAD_DOC` on padding."""

    tokens: np.ndarray
    doc_ids: np.ndarray

    def __len__(self) -> int:
        return len(self.tokens)


def pack_documents(docs: Sequence[np.ndarray], seq_len: int, dtype: Any = None) -> Packed:
    """The documents concatenated and cut into windows of ``seq_len + 1`` every ``seq_len`` tokens
    (so every token but the first is a target exactly once); the last window padded. Empty
    documents hold no token and are skipped."""
    docs = [d for d in docs if len(d)]  # consecutive indices: an empty document would leave a gap
    lengths = np.array([len(d) for d in docs], dtype=np.int64)
    stream = np.concatenate([np.asarray(d) for d in docs]) if len(docs) else np.zeros(0, np.int64)
    if dtype is not None:
        stream = stream.astype(dtype, copy=False)
    doc_of = np.repeat(np.arange(len(docs), dtype=np.int64), lengths)
    n = -(-(len(stream) - 1) // seq_len) if len(stream) > 1 else 0
    pad = n * seq_len + 1 - len(stream) if n else 0
    stream = np.concatenate([stream, np.zeros(pad, stream.dtype)])[: n * seq_len + 1]
    doc_of = np.concatenate([doc_of, np.full(pad, -1, np.int64)])[: n * seq_len + 1]

    def cut(a: np.ndarray) -> np.ndarray:  # windows as a strided view: no index array of the corpus's size
        if not n:
            return a[:0].reshape(0, seq_len + 1)
        return np.lib.stride_tricks.sliding_window_view(a, seq_len + 1)[::seq_len]
    docs_at = cut(doc_of)
    local = np.where(docs_at >= 0, docs_at - docs_at[:, :1], PAD_DOC).astype(np.int32)
    return Packed(np.ascontiguousarray(cut(stream)), local)


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


def packed_fields(packed: Packed) -> list[dict[str, np.ndarray]]:
    """Each packed window's shard fields: its tokens (``npy``), its document starts and real length (``doc.npy``)."""
    return [{"npy": packed.tokens[i], "doc.npy": doc_bounds(packed.doc_ids[i])} for i in range(len(packed))]


def window_samples(fields: list[dict[str, np.ndarray]], split: str) -> Samples:
    """The windows as shard samples, in a fixed shuffled order (seed 0) so no shard holds one document."""
    order = np.random.default_rng(0).permutation(len(fields))
    for i, row in enumerate(order):
        yield sample_key(split, i), {ext: npy_bytes(a) for ext, a in fields[row].items()}


def table_texts(table: Any, name: str, key: str | None, setting: str = "data.input_key") -> tuple[list[str], str]:
    """A table's text column (``key``, else the first of :data:`TEXT_COLUMNS`) and its name; a
    missing column or a row that is not text is refused, named."""
    columns = list(table.column_names)
    column = key or next((c for c in TEXT_COLUMNS if c in columns), None)
    if column is None or column not in columns:
        raise DataFormatError(f"{name} has no text column {key or ' / '.join(TEXT_COLUMNS)!r}; its columns are "
                              f"{columns}; hint: {setting}=COLUMN names the text")
    texts = table.column(column).to_pylist()
    bad = next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)
    if bad is not None:
        raise DataFormatError(f"{name}: column {column!r} row {bad} holds {type(texts[bad]).__name__}, not text; "
                              f"hint: {setting}=COLUMN names the text column")
    return texts, column


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
