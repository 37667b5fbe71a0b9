"""The shard format: WebDataset-layout tar files, a manifest per split, a byte index per shard.

Layout of ``OUT_DIR`` for one split (``train`` here)::

    train-000000.tar        USTAR tar: <key>.cls, <key>.png (or .npy/.json) per sample
    train-000000.idx.json   byte offsets of every sample and field, CRC-32 per sample
    train.manifest.json     samples, bytes and sha256 per shard; fields; classes; decode info

The tars are plain WebDataset shards (``webdataset.WebDataset`` reads them unchanged).
USTAR headers, not PAX: the same data is ~30% smaller and faster to read (ANCHORS.md).
The index lets the loader read a sample with one ``pread`` instead of parsing tar
headers (~80-100 us per sample in Python). The per-sample CRC-32 covers headers and
data, so a flipped byte is caught at read time and named by shard and key.

Every shard, index and manifest is written under a temporary name and renamed when
whole, and the manifest comes last: an interrupted run never leaves a shard that looks
complete.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import tarfile
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hpctrain.errors import RunError, UserError

# Atomic writes fsync the file and its directory (rundir owns the helpers; hpctrain.data uses these names)
from hpctrain.rundir import atomic_write_bytes as write_atomic
from hpctrain.rundir import replace_durably

FORMAT = "hpctrain-shards"
VERSION = 1
BLOCK = 512
IMAGE_EXTS = ("png", "jpg", "jpeg")
INPUT_EXTS = (*IMAGE_EXTS, "npy")
_KEY_RE = re.compile(r"^[A-Za-z0-9_\-/]+$")


class ShardError(UserError):
    """A shard directory, manifest or index is missing or inconsistent; the message names it."""


class CorruptSampleError(RunError):
    """A sample's bytes do not match the index (truncated shard, flipped byte, bad encoding)."""


def data_dir(root: str | Path, manifest: dict[str, Any]) -> Path:
    """Where a split's tars are: next to the manifest, or ``data_dir`` when the index was
    written elsewhere (a read-only data directory, a brace pattern; see hpctrain.data.foreign)."""
    return Path(manifest.get("data_dir") or root)


def manifest_path(root: str | Path, split: str) -> Path:
    return Path(root) / f"{split}.manifest.json"


def shard_name(split: str, number: int) -> str:
    return f"{split}-{number:06d}.tar"


def index_name(shard: str) -> str:
    return shard[: -len(".tar")] + ".idx.json"


# ---------------------------------------------------------------- writing


def _ustar_header(name: str, size: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = size, 0o444, 0  # fixed mtime: same data -> same bytes
    info.uname = info.gname = "hpctrain"
    return info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "strict")


def _padded(size: int) -> int:
    return -(-size // BLOCK) * BLOCK


def encode_sample(key: str, fields: dict[str, bytes]) -> tuple[bytes, list[tuple[str, int, int]]]:
    """The tar bytes of one sample and (ext, offset, size) of each field, relative to its start."""
    if not _KEY_RE.match(key) or len(key) > 80:
        raise ShardError(f"sample key {key!r} must be <= 80 characters of letters, digits, '_', '-', '/' "
                         "(no dots: WebDataset splits the key from the extension at the first dot)")
    parts: list[bytes] = []
    layout: list[tuple[str, int, int]] = []
    pos = 0
    for ext, data in fields.items():
        header = _ustar_header(f"{key}.{ext}", len(data))
        parts += [header, data, b"\0" * (_padded(len(data)) - len(data))]
        layout.append((ext, pos + len(header), len(data)))
        pos += len(header) + _padded(len(data))
    return b"".join(parts), layout


@dataclass
class _OpenShard:
    name: str
    tmp: Path
    fh: Any
    sha: Any = field(default_factory=hashlib.sha256)
    keys: list[str] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)
    crcs: list[int] = field(default_factory=list)
    offsets: list[list[int]] = field(default_factory=list)
    size: int = 0

    def write(self, data: bytes) -> None:
        self.fh.write(data)
        self.sha.update(data)
        self.size += len(data)


class ShardWriter:
    """Writes samples into ``<split>-NNNNNN.tar`` shards, their indexes, then the manifest.

    A shard is closed when it holds ``samples_per_shard`` samples or would pass
    ``max_bytes``. Use as a context manager; ``close()`` writes the manifest.
    """

    def __init__(self, root: str | Path, split: str, *, samples_per_shard: int | None = None,
                 max_bytes: int | None = None, meta: dict[str, Any] | None = None) -> None:
        if samples_per_shard is None and max_bytes is None:
            max_bytes = 256 * 2**20
        bad_count = samples_per_shard is not None and samples_per_shard <= 0
        if bad_count or (max_bytes is not None and max_bytes <= BLOCK * 4):
            raise ShardError(f"shard limits must be positive (samples_per_shard={samples_per_shard}, "
                             f"max_bytes={max_bytes}, at least 2048 bytes)")
        self.root, self.split = Path(root), split
        self.root.mkdir(parents=True, exist_ok=True)
        self.samples_per_shard, self.max_bytes = samples_per_shard, max_bytes
        self.meta = dict(meta or {})
        self.fields: list[str] | None = None
        self.done: list[dict[str, Any]] = []
        self.current: _OpenShard | None = None
        self.count = 0

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self._abort()

    def write(self, key: str, fields: dict[str, bytes]) -> None:
        if self.fields is None:
            self.fields = list(fields)
        elif list(fields) != self.fields:
            raise ShardError(f"sample {key!r} has fields {list(fields)}, the first sample had {self.fields}; "
                             "hint: every sample of a split needs the same fields")
        data, layout = encode_sample(key, fields)
        shard = self._shard_for(len(data))
        start = shard.size
        shard.write(data)
        shard.keys.append(key)
        shard.starts.append(start)
        shard.ends.append(shard.size)
        shard.crcs.append(zlib.crc32(data))
        shard.offsets.append([v for _, off, size in layout for v in (off, size)])
        self.count += 1

    def _shard_for(self, nbytes: int) -> _OpenShard:
        cur = self.current
        if cur is not None:
            full = self.samples_per_shard is not None and len(cur.keys) >= self.samples_per_shard
            big = self.max_bytes is not None and cur.keys and cur.size + nbytes + 2 * BLOCK > self.max_bytes
            if full or big:
                self._finish_shard()
        if self.current is None:
            name = shard_name(self.split, len(self.done))
            tmp = self.root / f".{name}.tmp-{os.getpid()}"
            self.current = _OpenShard(name, tmp, open(tmp, "wb"))
        return self.current

    def _finish_shard(self) -> None:
        cur = self.current
        if cur is None:
            return
        cur.write(b"\0" * (2 * BLOCK))  # end-of-archive marker
        cur.fh.flush()
        os.fsync(cur.fh.fileno())
        cur.fh.close()
        index = {"format": FORMAT, "version": VERSION, "shard": cur.name, "fields": self.fields,
                 "keys": cur.keys, "start": cur.starts, "end": cur.ends, "crc32": cur.crcs,
                 "offsets": cur.offsets}
        index_bytes = json.dumps(index, separators=(",", ":")).encode()
        write_atomic(self.root / index_name(cur.name), index_bytes)
        replace_durably(cur.tmp, self.root / cur.name)  # the shard appears only when whole
        self.done.append({"name": cur.name, "samples": len(cur.keys), "bytes": cur.size,
                          "sha256": cur.sha.hexdigest(), "index": index_name(cur.name),
                          "index_sha256": hashlib.sha256(index_bytes).hexdigest()})
        self.current = None

    def _abort(self) -> None:
        if self.current is not None:
            self.current.fh.close()
            self.current.tmp.unlink(missing_ok=True)
            self.current = None

    def close(self) -> dict[str, Any]:
        self._finish_shard()
        if not self.done:
            raise ShardError(f"no samples were written to {self.root} (split {self.split}); is the source empty?")
        manifest = {"format": FORMAT, "version": VERSION, "split": self.split, "fields": self.fields,
                    "total_samples": self.count, **self.meta, "shards": self.done}
        write_atomic(manifest_path(self.root, self.split), json.dumps(manifest, indent=1).encode())
        return manifest


def write_shards(samples: Iterable[tuple[str, dict[str, bytes]]], root: str | Path, split: str, *,
                 samples_per_shard: int | None = None, max_bytes: int | None = None,
                 meta: dict[str, Any] | None = None, progress: Callable[[int], object] | None = None) -> dict[str, Any]:
    """Write an iterable of (key, {ext: bytes}) as shards; returns the manifest."""
    with ShardWriter(root, split, samples_per_shard=samples_per_shard, max_bytes=max_bytes, meta=meta) as writer:
        for key, fields in samples:
            writer.write(key, fields)
            if progress is not None:
                progress(1)
    return json.loads(manifest_path(root, split).read_text())


def parse_size(text: str) -> int:
    """'256MB' -> bytes (KB/MB/GB are powers of 1024, as for file sizes)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)\s*", text, re.IGNORECASE)
    if not match:
        raise ShardError(f"shard size {text!r} is not a size; examples: 256MB, 1GB, 500000")
    unit = match.group(2).upper().rstrip("B").rstrip("I")
    return int(float(match.group(1)) * 1024 ** " KMGT".index(unit or " "))


# ---------------------------------------------------------------- reading the manifest and index


def load_manifest(root: str | Path, split: str) -> dict[str, Any]:
    path = manifest_path(root, split)
    if not path.is_file():
        have = sorted(p.name for p in Path(root).glob("*.manifest.json")) if Path(root).is_dir() else []
        raise ShardError(f"no manifest {path} (found: {have or 'none'}); hint: hpctrain data shard SOURCE {root} "
                         f"--split {split}, or `hpctrain data index {root} --split {split}` for tars written elsewhere")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ShardError(f"manifest {path} is not valid JSON: {err}") from err
    if manifest.get("format") != FORMAT:
        raise ShardError(f"{path} is not an hpctrain shard manifest (format {manifest.get('format')!r})")
    return manifest


def load_index(root: str | Path, shard: dict[str, Any]) -> dict[str, Any]:
    path = Path(root) / shard["index"]
    try:
        index = json.loads(path.read_bytes())
    except (OSError, json.JSONDecodeError) as err:
        raise ShardError(f"index {path} of shard {shard['name']} cannot be read: {err}; "
                         "hint: re-run `hpctrain data index` or re-shard") from err
    if len(index["keys"]) != shard["samples"]:
        raise ShardError(f"index {path} lists {len(index['keys'])} samples, the manifest says {shard['samples']}")
    return index


# ---------------------------------------------------------------- indexing tars written elsewhere


def _split_name(name: str) -> tuple[str, str]:
    """WebDataset's rule: the key is the path up to the first dot of the file name."""
    directory, _, base = name.rpartition("/")
    stem, _, ext = base.partition(".")
    return (f"{directory}/{stem}" if directory else stem), ext


# Label fields of tars written elsewhere, in the order they are looked for: a text integer
# per sample (WebDataset's convention is .cls), else an integer member of a .json record.
LABEL_EXTS = ("cls", "label", "target", "class", "cls2", "index")
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
            k, ext = _split_name(m.name)
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
        start, end = members[0][1], members[-1][2] + _padded(members[-1][3])
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
        write_atomic(out / index_name(tar.name), index_bytes)
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
    write_atomic(manifest_path(out, split), json.dumps(manifest, indent=1).encode())
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


def file_sha256(path: Path, chunk: int = 4 * 2**20) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            sha.update(block)
    return sha.hexdigest()


# ---------------------------------------------------------------- verification


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
    (tar headers name the indexed keys at the indexed offsets; CRC-32 per sample)."""
    root = Path(root)
    manifest = load_manifest(root, split)
    problems: list[Problem] = []
    for shard in manifest["shards"]:
        problems += verify_shard(root, shard, deep=deep, tars=data_dir(root, manifest))
    return problems


def verify_shard(root: Path, shard: dict[str, Any], *, deep: bool = True, tars: Path | None = None) -> list[Problem]:
    """``tars``: the directory of the tar files when it is not ``root`` (see :func:`data_dir`)."""
    path = (tars or root) / shard["name"]
    if not path.is_file():
        return [Problem(shard["name"], None, "file is missing")]
    try:
        index = load_index(root, shard)
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
    problems += _check_samples(path, shard["name"], index)
    return problems


def _first_beyond(index: dict[str, Any], size: int) -> str | None:
    for key, end in zip(index["keys"], index["end"]):
        if end > size:
            return key
    return None


def _check_samples(path: Path, name: str, index: dict[str, Any]) -> list[Problem]:
    problems = []
    raw = path.read_bytes()
    fields = index["fields"]
    for i, key in enumerate(index["keys"]):
        start, end = index["start"][i], index["end"][i]
        chunk = raw[start:end]
        if len(chunk) != end - start:
            problems.append(Problem(name, key, f"bytes {start}..{end} lie beyond the end of the file ({len(raw)})"))
            continue
        if zlib.crc32(chunk) != index["crc32"][i]:
            problems.append(Problem(name, key, "CRC-32 differs from the index (corrupt bytes)"))
            continue
        problems += _check_headers(raw, name, key, start, fields, index["offsets"][i])
    return problems


def _check_headers(raw: bytes, name: str, key: str, start: int, fields: list[str], offsets: list[int]) -> list[Problem]:
    """The tar header right before each field must name <key>.<ext> with the indexed size."""
    for j, ext in enumerate(fields):
        off, size = start + offsets[2 * j], offsets[2 * j + 1]
        try:
            info = tarfile.TarInfo.frombuf(raw[off - BLOCK : off], "utf-8", "surrogateescape")
        except tarfile.HeaderError as err:
            return [Problem(name, key, f"no valid tar header before field .{ext}: {err}")]
        if info.size != size or _split_name(info.name) != (key, ext):
            return [Problem(name, key, f"tar header says {info.name!r} ({info.size} bytes), "
                                       f"index says {key}.{ext} ({size} bytes)")]
    return []


def summarize(root: str | Path) -> list[dict[str, Any]]:
    """Per split: samples, shards, bytes, fields, classes (for ``hpctrain data inspect``)."""
    out = []
    for path in sorted(Path(root).glob("*.manifest.json")):
        m = json.loads(path.read_text())
        sizes = [s["bytes"] for s in m["shards"]]
        counts = [s["samples"] for s in m["shards"]]
        out.append({"split": m["split"], "samples": m["total_samples"], "shards": len(sizes),
                    "bytes": sum(sizes), "samples_per_shard": [min(counts), max(counts)],
                    "fields": m["fields"], "classes": m.get("classes", []), "source": m.get("source"),
                    "decode": m.get("decode")})
    return out


def npy_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(array), allow_pickle=False)
    return buf.getvalue()


# ---------------------------------------------------------------- sources to pack

Samples = Iterator[tuple[str, dict[str, bytes]]]


@dataclass
class PackSource:
    """What ``hpctrain data shard`` packs: samples, their count, and manifest metadata."""

    samples: Samples
    size: int
    meta: dict[str, Any]


def _png(pixels: np.ndarray) -> bytes:
    from PIL import Image  # optional dependency (extra "shards")

    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG", compress_level=1)  # fast to write, still lossless
    return buf.getvalue()


def _cls(label: int) -> bytes:
    return str(int(label)).encode()


def _image_source(images: np.ndarray, labels: np.ndarray, split: str, meta: dict[str, Any]) -> PackSource:
    def gen() -> Samples:
        for i in range(len(labels)):
            yield f"{split}_{i:08d}", {"cls": _cls(labels[i]), "png": _png(images[i])}
    return PackSource(gen(), len(labels), meta)


def mnist_source(split: str, path: str | None = None) -> PackSource:
    import gzip
    import pickle

    from hpctrain.data.sources import MNIST_MEAN, MNIST_STD, SPLITS, mnist_file

    with gzip.open(mnist_file(path), "rb") as fh:
        images, labels = pickle.load(fh, encoding="latin1")[SPLITS.index(split)]
    # The pickle holds pixel/256 exactly, so pixel = value*256 is lossless; decoding with
    # scale 256 gives back the in-memory tensors of hpctrain.data.sources bit for bit.
    pixels = np.rint(np.asarray(images).reshape(-1, 28, 28) * 256).clip(0, 255).astype(np.uint8)
    meta = {"source": "mnist", "classes": [str(i) for i in range(10)],
            "decode": {"input": "png", "target": "cls", "scale": 256.0, "mean": [MNIST_MEAN], "std": [MNIST_STD]}}
    return _image_source(pixels, np.asarray(labels), split, meta)


def fashion_source(split: str, path: str | None = None) -> PackSource:
    from hpctrain.data.sources import FASHION_DIR, FASHION_MEAN, FASHION_STD, DataMissingError, read_idx

    root, stem = Path(path) if path else FASHION_DIR, "train" if split == "train" else "t10k"
    found = []
    for kind in ("images-idx3-ubyte", "labels-idx1-ubyte"):
        names = [root / f"{stem}-{kind}{gz}" for gz in (".gz", "")]
        hit = [n for n in names if n.is_file()]
        if not hit:
            raise DataMissingError(f"Fashion-MNIST file {names[1]}[.gz] not found; "
                                   "hint: apt-get install dataset-fashion-mnist")
        found.append(read_idx(hit[0]))
    meta = {"source": "fashion_mnist", "classes": [str(i) for i in range(10)],
            "decode": {"input": "png", "target": "cls", "scale": 255.0, "mean": [FASHION_MEAN], "std": [FASHION_STD]}}
    return _image_source(found[0], found[1], split, meta)


def imagefolder_source(root: str, split: str) -> PackSource:
    """``ROOT/<class>/<image>``; the image bytes are stored as they are (no re-encoding)."""
    base = Path(root)
    if not base.is_dir():
        raise ShardError(f"imagefolder {root} is not a directory; hint: imagefolder:PATH with one subfolder per class")
    classes = sorted(p.name for p in base.iterdir() if p.is_dir())
    files = [(c, f) for c_i, c in enumerate(classes) for f in sorted((base / c).iterdir())
             if f.suffix.lower().lstrip(".") in IMAGE_EXTS]
    if not files:
        raise ShardError(f"imagefolder {root} holds no .png/.jpg files in class subfolders")
    exts = {f.suffix.lower().lstrip(".").replace("jpeg", "jpg") for _, f in files}
    if len(exts) > 1:
        raise ShardError(f"imagefolder {root} mixes image types {sorted(exts)}; hint: convert to one type")
    ext = exts.pop()
    lookup = {c: i for i, c in enumerate(classes)}
    # Class folders come sorted; mix them once here so no shard holds a single class
    # (the loader's shard-level shuffle cannot undo a class-sorted file).
    files = [files[i] for i in np.random.default_rng(0).permutation(len(files))]

    def gen() -> Samples:
        for i, (cls_name, file) in enumerate(files):
            yield f"{split}_{i:08d}", {"cls": _cls(lookup[cls_name]), ext: file.read_bytes()}
    meta = {"source": f"imagefolder:{root}", "classes": classes,
            "decode": {"input": ext, "target": "cls", "scale": 255.0, "mean": None, "std": None}}
    return PackSource(gen(), len(files), meta)


def npz_source(path: str, split: str) -> PackSource:
    """Arrays ``x``/``y`` (or ``images``/``labels``, or the first two) of an .npz file; raw .npy per sample."""
    data = np.load(path, allow_pickle=False)
    names = list(data.files)
    pick = next(((a, b) for a, b in (("x", "y"), ("images", "labels"), ("inputs", "targets"))
                 if a in names and b in names), tuple(names[:2]))
    if len(pick) != 2:
        raise ShardError(f"{path} needs two arrays (inputs, labels); it has {names}")
    x, y = data[pick[0]], data[pick[1]]
    if len(x) != len(y):
        raise ShardError(f"{path}: {pick[0]} has {len(x)} rows, {pick[1]} has {len(y)}")

    def gen() -> Samples:
        for i in range(len(y)):
            yield f"{split}_{i:08d}", {"cls": _cls(y[i]), "npy": npy_bytes(x[i])}
    meta = {"source": f"npz:{path}", "classes": [str(i) for i in range(int(y.max()) + 1)],
            "decode": {"input": "npy", "target": "cls"}}
    return PackSource(gen(), len(y), meta)


def jsonl_source(path: str, split: str) -> PackSource:
    """One JSON object per line; ``label`` (if present) becomes ``.cls``, the record ``.json``."""
    lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
    records = []
    for n, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            raise ShardError(f"{path} line {n} is not JSON: {err}") from err
    labels = [r.get("label") for r in records if isinstance(r, dict)]
    has_label = bool(labels) and all(isinstance(v, int) for v in labels) and len(labels) == len(records)

    def gen() -> Samples:
        for i, rec in enumerate(records):
            fields = {"cls": _cls(rec["label"])} if has_label else {}
            fields["json"] = json.dumps(rec).encode()
            yield f"{split}_{i:08d}", fields
    classes = [str(i) for i in range(max(int(v) for v in labels if v is not None) + 1)] if has_label else []
    meta = {"source": f"jsonl:{path}", "classes": classes,
            "decode": {"input": "json", "target": "cls" if has_label else None}}
    return PackSource(gen(), len(records), meta)


def synthetic_cifar_source(size: int, split: str, seed: int = 0) -> PackSource:
    from hpctrain.data.sources import synthetic

    data = synthetic(split, size, (3, 32, 32), seed=seed)
    x, y = data.inputs.numpy(), data.targets.numpy()

    def gen() -> Samples:
        for i in range(len(y)):
            yield f"{split}_{i:08d}", {"cls": _cls(y[i]), "npy": npy_bytes(x[i])}
    meta = {"source": f"synthetic_cifar:{size}", "classes": [str(i) for i in range(10)],
            "decode": {"input": "npy", "target": "cls"}}
    return PackSource(gen(), len(y), meta)


def open_source(spec: str, split: str) -> PackSource:
    """``mnist`` | ``fashion_mnist`` | ``imagefolder:PATH`` | ``npz:PATH`` | ``jsonl:PATH`` | ``synthetic_cifar:N``."""
    kind, _, arg = spec.partition(":")
    if kind == "mnist":
        return mnist_source(split, arg or None)
    if kind == "fashion_mnist":
        return fashion_source(split, arg or None)
    if kind in ("imagefolder", "npz", "jsonl") and arg:
        return {"imagefolder": imagefolder_source, "npz": npz_source, "jsonl": jsonl_source}[kind](arg, split)
    if kind == "synthetic_cifar" and arg.isdigit() and int(arg) > 0:
        return synthetic_cifar_source(int(arg), split)
    raise ShardError(f"unknown source {spec!r}; choose one of: mnist, fashion_mnist, imagefolder:PATH, "
                     "npz:PATH, jsonl:PATH, synthetic_cifar:N")
