"""Indexing tars written elsewhere (``webdataset.ShardWriter``, ``tar``; PAX, GNU or USTAR headers):
byte ranges and a CRC-32 per sample, the input and label fields found by looking, and a manifest
(``hpctrain data index``). Where and when ``data.path`` is indexed on first use:
:mod:`hpctrain.data.foreign`.
"""

from __future__ import annotations

import hashlib
import json
import tarfile
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

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
from hpctrain.rundir import atomic_write_bytes

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
    except (UnicodeDecodeError, json.JSONDecodeError):
        return {}
    if not isinstance(record, dict):
        return {}
    return {f"json:{k}": record[k] for k in JSON_LABEL_KEYS if type(record.get(k)) is int}


def _scan_tar(path: Path) -> Iterator[tuple[str, list[tuple[str, int, int, int]], dict[str, int]]]:
    """(key, [(ext, header_offset, data_offset, size)], label candidates) per sample, in file order."""
    with tarfile.open(path, "r:") as tf:
        key: str | None = None
        members: list[tuple[str, int, int, int]] = []
        labels: dict[str, int] = {}
        for m in tf:
            if not m.isfile():
                continue
            k, ext = split_key(m.name)
            if k != key and members:
                yield key, members, labels  # type: ignore[misc]
                members, labels = [], {}
            key = k
            members.append((ext, m.offset, m.offset_data, m.size))
            if ext in LABEL_EXTS or ext == "json":
                labels.update(_labels_of(ext, tf.extractfile(m).read()))  # type: ignore[union-attr]
        if members:
            yield key, members, labels  # type: ignore[misc]


def index_tar(path: Path) -> tuple[dict[str, Any], dict[str, set[int]]]:
    """Build the index of an existing tar (any writer, PAX or USTAR) and, per label candidate
    (``cls``, ``json:label``, ...) that every sample has, the labels it holds."""
    try:
        raw = path.read_bytes()
        scanned = list(_scan_tar(path))
    except (OSError, tarfile.TarError) as err:
        raise ShardError(f"{path} cannot be read as a tar file: {err}; hint: check the file (tar tf {path})") from err
    keys, starts, ends, crcs, offsets = [], [], [], [], []
    fields: list[str] | None = None
    found: dict[str, set[int]] | None = None
    for key, members, labels in scanned:
        exts = [m[0] for m in members]
        if fields is None:
            fields = exts
        elif exts != fields:
            raise ShardError(f"{path}: sample {key!r} has fields {exts}, earlier samples have {fields}")
        start, end = members[0][1], members[-1][2] + padded(members[-1][3])
        keys.append(key)
        starts.append(start)
        ends.append(end)
        crcs.append(zlib.crc32(raw[start:end]))
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
