"""Indexing tars written elsewhere (``webdataset.ShardWriter``, ``tar``; PAX, GNU or USTAR headers):
byte ranges and a CRC-32 per sample, the input and label fields found by looking, and a manifest
(``hpctrain data index``). Where and when ``data.path`` is indexed on first use:
:mod:`hpctrain.data.foreign`.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from hpctrain.core.atomic import atomic_write_bytes
from hpctrain.core.safe_open import NotRegularError, open_regular
from hpctrain.data.errors import ShardError
from hpctrain.data.manifest import (
    FORMAT,
    IMAGE_EXTS,
    INPUT_EXTS,
    LABEL_EXTS,
    VERSION,
    file_sha256,
    index_name,
    manifest_path,
    padded,
    split_key,
)

# After the label fields (LABEL_EXTS), an integer member of a sample's .json record, in this order.
JSON_LABEL_KEYS = ("label", "cls", "class", "target")


def _labels_of(ext: str, data: bytes) -> dict[str, int]:
    """The label candidates one small member offers: {"cls": 3} or {"json:label": 3}."""
    if ext in LABEL_EXTS:
        try:
            return {ext: int(data.decode().strip())}
        except (UnicodeDecodeError, ValueError):
            return {}
    try:
        record = json.loads(data)
    except (ValueError, RecursionError):  # not UTF-8, not JSON, nested too deep
        return {}
    if not isinstance(record, dict):
        return {}
    return {f"json:{k}": record[k] for k in JSON_LABEL_KEYS if type(record.get(k)) is int}


# A label member (.cls, or the .json record a label is looked for in) larger than this is not
# parsed: its bytes would be read whole, and a crafted header may declare any size.
MAX_LABEL_BYTES = 2**20
Members = list[tuple[str, int, int, int]]  # (ext, header offset, data offset, size) per field of a sample


class _Capped:
    """A file whose reads never ask for more than it holds: tarfile reads a PAX header or a GNU
    long name of the size its header declares in one call, and a crafted size would be allocated."""

    def __init__(self, fh: BinaryIO, size: int) -> None:
        self.fh, self.size, self.name = fh, size, getattr(fh, "name", None)

    def read(self, n: int | None = -1) -> bytes:
        left = max(0, self.size - self.fh.tell())
        return self.fh.read(left if n is None or n < 0 else min(n, left))

    def seek(self, pos: int, whence: int = 0) -> int:
        return self.fh.seek(pos, whence)

    def tell(self) -> int:
        return self.fh.tell()


def _open_regular(path: Path) -> BinaryIO:
    """``path`` opened for reading only if it is a regular file (a FIFO would block tarfile forever)."""
    try:
        raw, _ = open_regular(path)
    except NotRegularError as err:  # a ValueError: named here, not as an unreadable tar
        raise ShardError(f"{path} is not a regular file (a FIFO, device or directory); hint: index tar files "
                         "only") from err
    return io.BufferedReader(raw)  # tarfile reads 512-byte blocks


def _scan_tar(path: Path, fh: BinaryIO, size: int) -> Iterator[tuple[str, Members, dict[str, int]]]:
    """(key, members, label candidates) per sample, in file order; a member whose declared size
    runs past the end of the file is refused before its bytes are read."""
    with tarfile.open(fileobj=_Capped(fh, size), mode="r:") as tf:  # type: ignore[call-overload]
        key: str | None = None
        members: Members = []
        labels: dict[str, int] = {}
        for m in tf:
            if not m.isfile():
                continue
            if m.offset_data + m.size > size:
                raise ShardError(f"{path}: member {m.name!r} declares {m.size} bytes at offset {m.offset_data}, past "
                                 f"the end of the file ({size} bytes): a truncated or damaged tar; hint: check it "
                                 f"(tar tvf {path}) and copy or write it again")
            k, ext = split_key(m.name)
            if k != key and members:
                yield key, members, labels  # type: ignore[misc]
                members, labels = [], {}
            key = k
            members.append((ext, m.offset, m.offset_data, m.size))
            if (ext in LABEL_EXTS or ext == "json") and m.size <= MAX_LABEL_BYTES:
                labels.update(_labels_of(ext, tf.extractfile(m).read()))  # type: ignore[union-attr]
        if members:
            yield key, members, labels  # type: ignore[misc]


def _read_tar(path: Path) -> tuple[list[tuple[str, Members, dict[str, int]]], list[int]]:
    """The samples of a tar and the CRC-32 of each one's bytes, read range by range (a tar may be
    larger than memory); any way the tar is malformed is a ShardError naming it."""
    try:
        with _open_regular(path) as fh:
            size = os.fstat(fh.fileno()).st_size
            scanned = list(_scan_tar(path, fh, size))
            crcs = []
            for key, members, _ in scanned:
                start, end = members[0][1], members[-1][2] + padded(members[-1][3])
                if end > size:
                    raise ShardError(f"{path} ends inside sample {key!r} (its last member's padding); a truncated "
                                     f"tar; hint: copy or write it again")
                crcs.append(_crc_range(fh.fileno(), start, end))
    except ShardError:
        raise  # already names the tar and its hint (a UserError is a ValueError too)
    except (OSError, tarfile.TarError, ValueError, OverflowError, EOFError) as err:
        raise ShardError(f"{path} cannot be read as a tar file: {err}; hint: check the file (tar tf {path})") from err
    return scanned, crcs


def _crc_range(fd: int, start: int, end: int, chunk: int = 4 * 2**20) -> int:
    crc = 0
    for pos in range(start, end, chunk):
        crc = zlib.crc32(os.pread(fd, min(chunk, end - pos), pos), crc)
    return crc


def index_tar(path: Path) -> tuple[dict[str, Any], dict[str, set[int]]]:
    """Build the index of an existing tar (any writer, PAX or USTAR) and, per label candidate
    (``cls``, ``json:label``, ...) that every sample has, the labels it holds."""
    scanned, crc_list = _read_tar(path)
    keys, starts, ends, crcs, offsets = [], [], [], [], []
    fields: list[str] | None = None
    found: dict[str, set[int]] | None = None
    for (key, members, labels), crc in zip(scanned, crc_list):
        exts = [m[0] for m in members]
        if fields is None:
            fields = exts
        elif exts != fields:
            raise ShardError(f"{path}: sample {key!r} has fields {exts}, earlier samples have {fields}")
        start, end = members[0][1], members[-1][2] + padded(members[-1][3])
        keys.append(key)
        starts.append(start)
        ends.append(end)
        crcs.append(crc)
        offsets.append([v for _, _, off, size in members for v in (off - start, size)])
        if found is None:
            found = {name: set() for name in labels}
        for name in list(found):  # a candidate counts only if every sample has it
            if name in labels:
                found[name].add(labels[name])
            else:
                del found[name]
    index = {"format": FORMAT, "version": VERSION, "shard": path.name, "fields": fields or [],
             "keys": keys, "start": starts, "end": ends, "crc32": crcs, "offsets": offsets}
    return index, found or {}


def tar_stats(tars: Iterable[Path]) -> dict[str, list[int]]:
    """{name: [bytes, mtime_ns]}: what an index of tars written elsewhere was built from."""
    out = {}
    for tar in tars:
        st = tar.stat()
        out[tar.name] = [st.st_size, st.st_mtime_ns]
    return out


def index_existing(root: str | Path, split: str, pattern: str | None = None, *, tars: list[Path] | None = None,
                   out: Path | None = None, require_label: bool = False, label_hint: str = "") -> dict[str, Any]:
    """Index tars written by another tool (e.g. ``webdataset.ShardWriter``) and write a manifest.

    ``tars`` (default: ``root`` globbed with ``pattern`` or ``<split>-*.tar``) are indexed into
    ``out`` (default ``root``); when ``out`` is another directory the manifest records
    ``data_dir`` so the loader reads the tars where they are. ``require_label``: refuse (before
    writing the manifest) tars whose samples have no input image/array or no label.
    """
    root = Path(root)
    out = out or root
    if tars is None:
        tars = sorted(root.glob(pattern or f"{split}-*.tar"))
    if not tars:
        raise ShardError(f"no tar files match {root / (pattern or f'{split}-*.tar')}")
    shards, fields = [], None
    labels: dict[str, set[int]] | None = None
    for tar in tars:
        index, found = index_tar(tar)
        if fields is None:
            fields = index["fields"]
        elif index["fields"] != fields:
            raise ShardError(f"{tar} has fields {index['fields']}, {tars[0].name} has {fields}")
        labels = found if labels is None else {k: labels[k] | v for k, v in found.items() if k in labels}
        index_bytes = json.dumps(index, separators=(",", ":")).encode()
        atomic_write_bytes(out / index_name(tar.name), index_bytes)
        shards.append({"name": tar.name, "samples": len(index["keys"]), "bytes": tar.stat().st_size,
                       "sha256": file_sha256(tar), "index": index_name(tar.name),
                       "index_sha256": hashlib.sha256(index_bytes).hexdigest()})
    decode = default_decode(fields or [], labels or {})
    if require_label and (decode["input"] is None or decode["target"] is None):
        what = "an image (.png/.jpg) or array (.npy)" if decode["input"] is None else "a label"
        raise ShardError(f"cannot find {what} in the samples of {root} (split {split}, fields {fields}); "
                         f"hint: {label_hint or 'see docs/data.md'}")
    target_labels = (labels or {}).get(decode["target"] if not decode.get("target_key")
                                       else f"json:{decode['target_key']}", set())
    manifest: dict[str, Any] = {
        "format": FORMAT, "version": VERSION, "split": split, "fields": fields,
        "total_samples": sum(s["samples"] for s in shards), "source": f"indexed:{pattern or split}",
        "classes": [str(i) for i in range(max(target_labels) + 1)] if target_labels else [],
        "decode": decode, "shards": shards, "indexed_from": tar_stats(tars)}
    if out.resolve() != root.resolve():
        manifest["data_dir"] = str(root.resolve())
    atomic_write_bytes(manifest_path(out, split), json.dumps(manifest, indent=1).encode())
    return manifest


def default_decode(fields: list[str], labels: dict[str, set[int]] | None = None) -> dict[str, Any]:
    """Decode info for shards written elsewhere: the first image/array field is the input
    (images scaled to [0, 1], no normalization); the label is the first of ``LABEL_EXTS``
    that every sample has, else an integer ``label``/``cls``/``class``/``target`` in ``.json``."""
    inputs = [f for f in fields if f.rsplit(".", 1)[-1] in INPUT_EXTS]
    labels = labels if labels is not None else {f: set() for f in fields if f in LABEL_EXTS}
    info: dict[str, Any] = {"input": inputs[0] if inputs else None, "target": None}
    for name in [*LABEL_EXTS, *(f"json:{k}" for k in JSON_LABEL_KEYS)]:
        if name in labels:
            field_name, _, key = name.partition(":")
            info["target"] = field_name
            if key:
                info["target_key"] = key
            break
    if inputs and inputs[0].rsplit(".", 1)[-1] in IMAGE_EXTS:
        info.update(scale=255.0, mean=None, std=None)
    return info
