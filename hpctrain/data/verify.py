"""Checking shards against their manifest and index (``hpctrain data verify``): sizes, sha256,
every tar header at its indexed offset, and each sample's CRC-32; problems name shard and key."""

from __future__ import annotations

import os
import re
import tarfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpctrain.data.errors import ShardError
from hpctrain.data.manifest import (
    BLOCK,
    LABEL_EXTS,
    data_dir,
    file_sha256,
    load_index,
    load_manifest,
    manifest_path,
    split_key,
)

_SHARD_NAME = re.compile(r"(?P<split>.+)-\d{6}\.tar")  # manifest.shard_name's pattern


@dataclass
class Problem:
    shard: str
    key: str | None
    message: str

    def __str__(self) -> str:
        where = f"{self.shard}" + (f" sample {self.key!r}" if self.key else "")
        return f"{where}: {self.message}"


def verify(root: str | Path, split: str, *, deep: bool = True) -> list[Problem]:
    """Check every shard of a split against the manifest (size, sha256) and its index
    (tar headers name the indexed keys at the indexed offsets; CRC-32 per sample; each label a
    class of the manifest)."""
    root = Path(root)
    manifest = load_manifest(root, split)
    problems: list[Problem] = [] if manifest["shards"] else [no_shards(split, str(root))]
    labels = label_spec(manifest)
    for shard in manifest["shards"]:
        problems += verify_shard(root, shard, deep=deep, tars=data_dir(root, manifest), labels=labels,
                                 fields=manifest["fields"])
    return problems


def no_shards(split: str, place: str) -> Problem:
    """A manifest that lists no shards: nothing to train or validate on, which no writer means."""
    return Problem(manifest_path("", split).name, None, f"lists no shards (no sample to read); hint: write the split "
                                                         f"again (hpctrain data shard SOURCE {place} --split {split})")


def label_spec(manifest: dict[str, Any]) -> tuple[str, int] | None:
    """The label field and the class count that bounds it, when the manifest lists classes and
    its labels are a field of their own (a label inside a .json record is the reader's to check)."""
    classes = manifest.get("classes") or []
    decode = manifest.get("decode") or {}
    fields = manifest.get("fields") or []
    field = decode.get("target") if "target" in decode else next((f for f in LABEL_EXTS if f in fields), None)
    if not classes or field is None or decode.get("target_key"):
        return None
    return field, len(classes)


def class_mismatches(root: str | Path, splits: list[str]) -> list[Problem]:
    """Splits whose class list differs from the training split's: the same label would mean
    another class there (an image folder's val split lacking a class, numbered by position)."""
    root = Path(root)
    if "train" not in splits:
        return []
    reference = load_manifest(root, "train").get("classes") or []
    problems = []
    for split in splits:
        classes = load_manifest(root, split).get("classes") or []
        if split != "train" and reference and classes and classes != reference:
            problems.append(Problem(manifest_path(root, split).name, None,
                                    f"classes {_shown(classes)} differ from train's {_shown(reference)}: a label "
                                    "means another class in each split; hint: re-shard this split into the same "
                                    "directory (image folders are numbered by train's class names), with "
                                    "--allow-missing-classes if it lacks some"))
    return problems


def _shown(classes: list[str]) -> str:
    return f"[{', '.join(map(str, classes[:6]))}{', ...' if len(classes) > 6 else ''}] ({len(classes)})"


def unlisted_shards(root: str | Path) -> list[Problem]:
    """Shards named like hpctrain's (``<split>-NNNNNN.tar``) in ``root`` whose split has no
    manifest there: a deleted or lost manifest, one problem per split. Tars a manifest lists
    (also foreign ones, indexed under any split name) are not reported."""
    root = Path(root)
    manifests = sorted(root.glob("*.manifest.json"))
    listed = set()
    for path in manifests:
        try:
            listed |= {s["name"] for s in load_manifest(root, path.name[: -len(".manifest.json")])["shards"]}
        except (ShardError, KeyError, TypeError):
            continue  # verify() reports a broken manifest itself
    unlisted: dict[str, list[str]] = {}
    for tar in sorted(root.glob("*.tar")):
        match = _SHARD_NAME.fullmatch(tar.name)
        if match and tar.name not in listed:
            unlisted.setdefault(match["split"], []).append(tar.name)
    return [Problem(names[0], None, f"{len(names)} shard(s) of split {split!r} but no manifest "
                                    f"{manifest_path(root, split)}: the split cannot be checked or read; hint: restore "
                                    f"{split}.manifest.json from where the shards came from, or write the split again "
                                    f"with `hpctrain data shard SOURCE {root} --split {split}`")
            for split, names in unlisted.items()]


def verify_shard(root: Path, shard: dict[str, Any], *, deep: bool = True, tars: Path | None = None,
                 labels: tuple[str, int] | None = None, fields: list[str] | None = None) -> list[Problem]:
    """``tars``: the directory of the tar files when it is not ``root`` (see :func:`data_dir`);
    ``labels``: the label field and class count to check each label against (:func:`label_spec`);
    ``fields``: the manifest's, which the index must list."""
    path = (tars or root) / shard["name"]  # a plain file name: load_manifest refuses any other
    if not path.is_file():
        return [Problem(shard["name"], None, "not a regular file (a FIFO, device or directory)" if path.exists()
                        else "file is missing")]
    try:
        index = load_index(root, shard, fields)
    except ShardError as err:
        return [Problem(shard["name"], None, str(err))]
    problems = []
    size = path.stat().st_size
    if size != shard["bytes"]:
        first = _first_beyond(index, size)
        problems.append(Problem(shard["name"], first, f"{size} bytes, manifest says {shard['bytes']} (truncated?)"))
    if not deep:
        return problems
    if file_sha256(path) != shard["sha256"]:
        problems.append(Problem(shard["name"], None, "sha256 differs from the manifest"))
    problems += _check_samples(path, shard["name"], index, labels)
    return problems


def _first_beyond(index: dict[str, Any], size: int) -> str | None:
    for key, end in zip(index["keys"], index["end"]):
        if end > size:
            return key
    return None


def _check_samples(path: Path, name: str, index: dict[str, Any], labels: tuple[str, int] | None) -> list[Problem]:
    """Each sample read by its own range (never the whole file: a shard can be larger than memory),
    ranges that :func:`load_index` checked, clamped to the file's size."""
    problems = []
    fields = index["fields"]
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        for i, key in enumerate(index["keys"]):
            start, end = int(index["start"][i]), int(index["end"][i])
            chunk = os.pread(fh.fileno(), max(0, min(end, size) - start), start) if end > start else b""
            if len(chunk) != end - start:
                problems.append(Problem(name, key, f"bytes {start}..{end} lie beyond the end of the file ({size})"))
                continue
            if zlib.crc32(chunk) != index["crc32"][i]:
                problems.append(Problem(name, key, "CRC-32 differs from the index (corrupt bytes)"))
                continue
            problems += _check_fields(chunk, name, key, fields, index["offsets"][i], labels)
    return problems


def _check_fields(chunk: bytes, name: str, key: str, fields: list[str], offsets: Any,
                  labels: tuple[str, int] | None) -> list[Problem]:
    """The tar headers of one sample (``chunk``: its bytes), then its label."""
    found = _check_headers(chunk, name, key, 0, fields, offsets)
    if not found and labels is not None and labels[0] in fields:
        j = fields.index(labels[0])
        off, size = int(offsets[2 * j]), int(offsets[2 * j + 1])
        found = _check_label(chunk[off : off + size], name, key, labels)
    return found


def _check_label(data: bytes, name: str, key: str, labels: tuple[str, int]) -> list[Problem]:
    """A label is a text integer in ``[0, classes)``, as the loader reads it."""
    field, count = labels
    text = data.decode("utf-8", "replace").strip()
    try:
        value = int(text)
    except ValueError:
        return [Problem(name, key, f"label .{field} is {text!r}, not an integer class id; hint: re-shard the data")]
    if not 0 <= value < count:
        return [Problem(name, key, f"label {value} is outside [0, {count}), the manifest's {count} classes; "
                                   "hint: fix the labels (or the manifest's classes) and re-shard")]
    return []


def _check_headers(raw: bytes, name: str, key: str, start: int, fields: list[str], offsets: Any) -> list[Problem]:
    """The tar header right before each field must name <key>.<ext> with the indexed size."""
    for j, ext in enumerate(fields):
        off, size = start + offsets[2 * j], offsets[2 * j + 1]
        try:
            info = tarfile.TarInfo.frombuf(raw[off - BLOCK : off], "utf-8", "surrogateescape")
        except tarfile.HeaderError as err:
            return [Problem(name, key, f"no valid tar header before field .{ext}: {err}")]
        if info.size != size or split_key(info.name) != (key, ext):
            return [Problem(name, key, f"tar header says {info.name!r} ({info.size} bytes), "
                                       f"index says {key}.{ext} ({size} bytes)")]
    return []
