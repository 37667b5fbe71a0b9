"""What a source's ``pack`` hook takes (:class:`PackOptions`) and gives (:class:`PackSource`:
samples as ``(key, {ext: bytes})``, their count, manifest metadata) for ``hpctrain data shard``,
and the field encoders the sources share."""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

Samples = Iterator[tuple[str, dict[str, bytes]]]
DEFAULT_SEQ_LEN = 128  # text: tokens per sample
VAL_FRACTION = 0.1  # text: the share of documents held out


@dataclass(frozen=True)
class PackOptions:
    """``hpctrain data shard`` flags, for the sources that read them (text)."""

    seq_len: int = DEFAULT_SEQ_LEN
    glob: str | None = None  # the documents of a directory or archive; None = the source's own
    val_fraction: float = VAL_FRACTION


DEFAULT_PACK = PackOptions()


@dataclass
class PackSource:
    """What ``hpctrain data shard`` packs: samples, their count, and manifest metadata."""

    samples: Samples
    size: int
    meta: dict[str, Any]


def sample_key(split: str, i: int) -> str:
    return f"{split}_{i:08d}"


def cls_bytes(label: int) -> bytes:
    return str(int(label)).encode()


def png_bytes(pixels: np.ndarray) -> bytes:
    from PIL import Image  # optional dependency (extra "shards")

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
