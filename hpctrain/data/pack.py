"""What a source's ``pack`` hook takes (:class:`PackOptions`) and gives (:class:`PackSource`:
samples as ``(key, {ext: bytes})``, their count, manifest metadata) for ``hpctrain data shard``,
and the field encoders the sources share."""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from hpctrain.data.errors import MissingPackageError, ShardError
from hpctrain.data.writer import parse_size  # the shard writer's size syntax, one parser

Samples = Iterator[tuple[str, dict[str, bytes]]]
DEFAULT_SEQ_LEN = 128  # text: tokens per sample
VAL_FRACTION = 0.1  # text: the share of documents held out (of one document: its tail's share of tokens)
# One document (a text file, a tar member, a jsonl line) is read and tokenized at once: this bounds
# the memory that takes (a tokenizer's encoding of 256 MiB is several GB); the variable raises it.
MAX_DOCUMENT_BYTES = 256 << 20
DOCUMENT_LIMIT_ENV = "HPCTRAIN_MAX_DOCUMENT_BYTES"


@dataclass(frozen=True)
class PackOptions:
    """``hpctrain data shard`` flags, for the sources that read them."""

    seq_len: int = DEFAULT_SEQ_LEN  # text
    glob: str | None = None  # text: the documents of a directory or archive; None = the source's own
    val_fraction: float = VAL_FRACTION  # text
    num_classes: int | None = None  # labelled sources: labels must lie in [0, num_classes); None = max label + 1
    image_size: int | None = None  # imagefolder: resize every image to image_size x image_size; None = one size
    classes: tuple[str, ...] | None = None  # imagefolder: another split's class names, which number the labels
    allow_missing_classes: bool = False  # imagefolder: this split may lack some of ``classes``
    input_columns: list[str] | None = None  # tables: the input columns; None = every column but the label
    label_column: str = "label"  # tables: the column of class ids
    packing: str = "windows"  # text: windows of one document, or documents packed (hpctrain.data.packed)
    tokenizer: str | None = None  # text: a Hugging Face tokenizer directory; None = bytes


DEFAULT_PACK = PackOptions()


@dataclass
class PackSource:
    """What ``hpctrain data shard`` packs: samples, their count, and manifest metadata."""

    samples: Samples
    size: int
    meta: dict[str, Any]


def document_limit() -> int:
    """The most bytes one document may hold: ``$HPCTRAIN_MAX_DOCUMENT_BYTES`` (``512MB``, ``1GB``,
    bytes), else :data:`MAX_DOCUMENT_BYTES`."""
    raw = os.environ.get(DOCUMENT_LIMIT_ENV, "").strip()
    if not raw:
        return MAX_DOCUMENT_BYTES
    try:
        return parse_size(raw)
    except ShardError:
        raise ShardError(f"{DOCUMENT_LIMIT_ENV}={raw!r} is not a size; examples: 512MB, 1GB, 300000000") from None


def check_document_size(what: str, size: int | None) -> None:
    """A document of ``size`` bytes (None: more than the limit, found while reading) within
    :func:`document_limit`, else refused naming ``what``, the limit and how to raise it."""
    limit = document_limit()
    if size is None or size > limit:
        holds = f"more than the {limit:,} bytes" if size is None else f"{size:,} bytes, more than the {limit:,}"
        raise ShardError(f"{what} holds {holds} one document may hold (it is read and tokenized at once); hint: "
                         f"split it into several documents (files, lines), or raise the limit: "
                         f"{DOCUMENT_LIMIT_ENV}=1GB")


def sample_key(split: str, i: int) -> str:
    return f"{split}_{i:08d}"


def cls_bytes(label: int) -> bytes:
    return str(int(label)).encode()


def pillow() -> ModuleType:
    """``PIL.Image``, or a UserError with the install command (Pillow is an optional dependency)."""
    try:
        from PIL import Image
    except ImportError as err:
        raise MissingPackageError(f"images need Pillow, which is not installed ({err}); "
                                  "hint: pip install pillow (or pip install 'hpctrain[shards]')") from err
    return Image


def check_labels(labels: Sequence[Any] | np.ndarray, where: Callable[[int], str], num_classes: int | None) -> int:
    """Class ids for classification: whole numbers in ``[0, num_classes)`` (default: max + 1, so
    only negatives can be out of range). A bad one is refused, named by ``where(i)``; returns the
    class count. Whole-number floats (1.0, as CSV readers give) are class ids; 1.5 is not."""
    y = np.asarray(labels)
    if y.ndim != 1 or not (np.issubdtype(y.dtype, np.integer) or np.issubdtype(y.dtype, np.floating)):
        raise ShardError(f"labels must be one integer class id per sample; got dtype {y.dtype}, shape {y.shape} "
                         f"(e.g. {where(0)}: {y.flat[0]!r}); hint: map class names to ids 0..C-1 first")
    fractional = np.flatnonzero(~np.isfinite(y) | (y != np.round(y)) if y.dtype.kind == "f" else np.zeros(len(y), bool))
    if len(fractional):
        i = int(fractional[0])
        raise ShardError(f"{where(i)} has label {y[i].item()!r}, not a whole number: classification needs class ids "
                         f"0..C-1 ({len(fractional)} such labels); hint: regression targets are not supported; "
                         "round or bin them into classes first")
    count = num_classes if num_classes is not None else (int(y.max()) + 1 if len(y) else 0)
    outside = np.flatnonzero((y < 0) | (y >= count))
    if len(outside):
        i = int(outside[0])
        raise ShardError(f"{where(i)} has label {int(y[i])}, outside [0, {count}) ({len(outside)} such labels); "
                         "hint: class ids run from 0 to num_classes - 1 (--num-classes sets the count)")
    return count


def png_bytes(pixels: np.ndarray) -> bytes:
    Image = pillow()  # noqa: N806 - the module, named as PIL names it
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG", compress_level=1)  # fast to write, still lossless
    return buf.getvalue()


def npy_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(array), allow_pickle=False)
    return buf.getvalue()


def labelled_samples(inputs: np.ndarray, labels: np.ndarray, split: str, meta: dict[str, Any], ext: str,
                     encode: Callable[[np.ndarray], bytes]) -> PackSource:
    """Each input encoded as ``.<ext>`` (``png_bytes``, ``npy_bytes``) with its class as ``.cls``."""
    def gen() -> Samples:
        for i in range(len(labels)):
            yield sample_key(split, i), {"cls": cls_bytes(labels[i]), ext: encode(inputs[i])}
    return PackSource(gen(), len(labels), meta)
