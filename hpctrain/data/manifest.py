"""The shard format's names and its read side: file names, the manifest, the per-shard index.

Layout of ``OUT_DIR`` for one split (``train`` here)::

    train-000000.tar        USTAR tar: <key>.cls, <key>.png (or .npy/.json) per sample
    train-000000.idx.json   byte offsets of every sample and field, CRC-32 per sample
    train.manifest.json     samples, bytes and sha256 per shard; fields; classes; decode info

The tars are plain WebDataset shards (``webdataset.WebDataset`` reads them unchanged).
The index lets the loader read a sample with one ``pread`` instead of parsing tar
headers (~80-100 us per sample in Python). The per-sample CRC-32 covers headers and
data, so a flipped byte is caught at read time and named by shard and key.

Writing: :mod:`hpctrain.data.writer`; indexing tars written elsewhere:
:mod:`hpctrain.data.indexing`; checking: :mod:`hpctrain.data.verify`.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from hpctrain.core import safe_open
from hpctrain.core.cache import cache_root
from hpctrain.data.errors import ShardError

FORMAT = "hpctrain-shards"
VERSION = 1
BLOCK = 512  # the tar block: headers and padded member data
IMAGE_EXTS = ("png", "jpg", "jpeg")
INPUT_EXTS = (*IMAGE_EXTS, "npy")
# Label fields, in the order they are looked for in tars written elsewhere: a text integer
# per sample (WebDataset's convention is .cls); the loader decodes them as int.
LABEL_EXTS = ("cls", "label", "target", "class", "cls2", "index")


# A manifest or index larger than this was not written by hpctrain (the index of a 256 MB shard of
# small samples is a few MB): refused before it is read (or downloaded, from a store), so a crafted
# file cannot exhaust memory. HPCTRAIN_MAX_JSON_BYTES raises it for a genuine giant.
MAX_JSON_BYTES = 2**30
JSON_LIMIT = safe_open.Limit("a shard manifest or index", "HPCTRAIN_MAX_JSON_BYTES", MAX_JSON_BYTES)
INDEX_DIR_PREFIX = ".hpctrain-index-"  # hpctrain.data.foreign's index of a brace pattern, inside the data directory
_HINT = "hint: write the split again (`hpctrain data shard` or `hpctrain data index`), then `hpctrain data verify`"


def data_dir(root: str | Path, manifest: dict[str, Any]) -> Path:
    """Where a split's tars are: next to the manifest, or ``data_dir`` when the index was
    written elsewhere (a read-only data directory, a brace pattern; see hpctrain.data.foreign).
    :func:`load_manifest` has checked that such a ``data_dir`` is one hpctrain may use."""
    return Path(manifest.get("data_dir") or root)


def plain_name(value: Any) -> bool:
    """A file name of one path component: no directory, no ``..``, nothing absolute."""
    return (isinstance(value, str) and value not in ("", ".", "..") and "/" not in value and "\\" not in value
            and "\0" not in value)


def read_regular(path: Path, what: str, limit: int | None = None) -> bytes:
    """The bytes of a regular file no larger than ``limit`` (default: :data:`JSON_LIMIT`;
    :mod:`hpctrain.core.safe_open`): a FIFO or device in its place is refused instead of stalling or
    streaming forever, and an oversized file is refused instead of allocated."""
    bound = JSON_LIMIT.bytes() if limit is None else limit
    try:
        return safe_open.read_regular(path, limit=bound)
    except safe_open.NotRegularError as err:
        raise ShardError(f"{what} {path} is not a regular file (a FIFO, device or directory); {_HINT}") from err
    except safe_open.TooLargeError as err:
        if limit is None:
            raise ShardError(JSON_LIMIT.refusal(f"{what} {path}", err.size)) from err
        raise ShardError(f"{what} {path} is {err.size} bytes, more than the {limit} a {what} can be; {_HINT}") from err
    except OSError as err:
        raise ShardError(f"{what} {path} cannot be opened: {err.strerror}; {_HINT}") from err


def parse_json(data: bytes, what: str, path: Path) -> Any:
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as err:  # bad JSON, bad UTF-8, a 5000-digit number, deep nesting
        raise ShardError(f"{what} {path} is not valid JSON: {str(err)[:200]}; {_HINT}") from err


def manifest_path(root: str | Path, split: str) -> Path:
    return Path(root) / f"{split}.manifest.json"


def shard_name(split: str, number: int) -> str:
    return f"{split}-{number:06d}.tar"


def index_name(shard: str) -> str:
    return shard[: -len(".tar")] + ".idx.json"


def padded(size: int) -> int:
    """A member's data size rounded up to whole tar blocks."""
    return -(-size // BLOCK) * BLOCK


def split_key(name: str) -> tuple[str, str]:
    """(key, ext) of a member name by WebDataset's rule: the key is the path up to the first dot
    of the file name."""
    directory, _, base = name.rpartition("/")
    stem, _, ext = base.partition(".")
    return (f"{directory}/{stem}" if directory else stem), ext


def load_manifest(root: str | Path, split: str) -> dict[str, Any]:
    """The manifest of ``split`` in ``root``, its structure checked: every value the readers use
    has its type, shard names are plain file names, and indexes and tars stay in ``root`` (or in
    the data directory an index directory of hpctrain's names)."""
    path = manifest_path(root, split)
    if not path.exists():
        have = sorted(p.name for p in Path(root).glob("*.manifest.json")) if Path(root).is_dir() else []
        raise ShardError(f"no manifest {path} (found: {have or 'none'}); hint: hpctrain data shard SOURCE {root} "
                         f"--split {split}, or `hpctrain data index {root} --split {split}` for tars written elsewhere")
    manifest = parse_json(read_regular(path, "manifest"), "manifest", path)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise ShardError(f"{path} is not an hpctrain shard manifest (format {found!r})")
    check_manifest(path, Path(root), manifest)
    return manifest


def check_manifest(path: Path, root: Path, manifest: dict[str, Any]) -> None:
    """Refuse (ShardError naming the manifest and the key) what no hpctrain writer produces."""
    def bad(what: str) -> ShardError:
        return ShardError(f"manifest {path}: {what}; {_HINT}")

    fields = manifest.get("fields")
    if not isinstance(fields, list) or not fields or not all(isinstance(f, str) and f for f in fields):
        raise bad(f"'fields' is {_shown(fields)}, not a list of field names")
    for key, kind in (("decode", dict), ("classes", list)):
        if manifest.get(key) is not None and not isinstance(manifest[key], kind):
            raise bad(f"'{key}' is {_shown(manifest[key])}, not a {kind.__name__}")
    _check_decode(manifest.get("decode") or {}, bad)
    shards = manifest.get("shards")
    if not isinstance(shards, list):
        raise bad(f"'shards' is {_shown(shards)}, not a list")
    tars = _checked_data_dir(root, manifest, bad)
    _check_remote(root, manifest, bad)
    for n, shard in enumerate(shards):
        _check_shard_entry(n, shard, tars, bad)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_decode(decode: dict[str, Any], bad: Any) -> None:
    for key in ("input", "target", "target_key"):
        if decode.get(key) is not None and not isinstance(decode[key], str):
            raise bad(f"decode.{key} is {_shown(decode[key])}, not a field name")
    scale = decode.get("scale")
    if scale is not None and (not isinstance(scale, (int, float)) or isinstance(scale, bool)):
        raise bad(f"decode.scale is {_shown(scale)}, not a number")
    for key in ("mean", "std"):
        value = decode.get(key)
        if value is not None and not (isinstance(value, list)
                                      and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)):
            raise bad(f"decode.{key} is {_shown(value)}, not a list of numbers")


def _checked_data_dir(root: Path, manifest: dict[str, Any], bad: Any) -> Path:
    """The tars' directory. A ``data_dir`` other than ``root`` is honoured only where hpctrain
    writes indexes of tars it cannot index in place (a pattern's ``DATA/.hpctrain-index-*``, or
    the cache): anywhere else it would send the reader outside the directory it was given."""
    value = manifest.get("data_dir")
    if value is None:
        return root
    if not isinstance(value, str) or not os.path.isabs(value):
        raise bad(f"'data_dir' is {_shown(value)}, not an absolute directory")
    here, there = root.resolve(), Path(value).resolve()
    ours = (here == there or (here.name.startswith(INDEX_DIR_PREFIX) and here.parent == there)
            or here.is_relative_to(cache_root().resolve() / "index"))
    if not ours:
        raise bad(f"'data_dir' {value!r} sends the reader outside {root}: only an index hpctrain wrote into its "
                  f"cache or a {INDEX_DIR_PREFIX}* folder may name the directory of its tars")
    return Path(value)


def _check_remote(root: Path, manifest: dict[str, Any], bad: Any) -> None:
    """A ``remote`` (the object-store URL of the tars) is honoured only in hpctrain's metadata mirror
    (:mod:`hpctrain.data.remote`): anywhere else it would send the reader to a store it was not given."""
    rec = manifest.get("remote")
    if rec is None:
        return
    sizes = rec.get("sizes", {}) if isinstance(rec, dict) else None
    if not (isinstance(rec, dict) and isinstance(rec.get("url"), str) and isinstance(rec.get("options", {}), dict)
            and isinstance(sizes, dict) and all(isinstance(k, str) and _count(v) for k, v in sizes.items())):
        raise bad(f"'remote' is {_shown(rec)}, not {{url, options, sizes}}")
    try:
        mirrored = root.resolve().parent == (cache_root() / "remote").resolve()
    except OSError:
        mirrored = False
    if not mirrored or "data_dir" in manifest:
        raise bad(f"'remote' {rec['url']!r}: only hpctrain's mirror of a store's indexes may name one")


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**62


def _check_shard_entry(n: int, shard: Any, tars: Path, bad: Any) -> None:
    """Shard ``n``: plain file names (read inside the data directory only), counts that are counts."""
    if not isinstance(shard, dict):
        raise bad(f"shard {n} is {_shown(shard)}, not an object")
    name = shard.get("name")
    if not plain_name(name):
        raise bad(f"shard {n} is named {_shown(name)}, not a file name in the data directory (no '/', no '..')")
    for key in ("samples", "bytes"):
        if not _count(shard.get(key)):
            raise bad(f"shard {name}: '{key}' is {_shown(shard.get(key))}, not a count")
    if not isinstance(shard.get("sha256"), str):
        raise bad(f"shard {name}: 'sha256' is {_shown(shard.get('sha256'))}, not a hex digest")
    index = shard.get("index")
    # an index beside the manifest, or (a mirrored manifest in the cache) beside the tars, by absolute path
    beside_tars = isinstance(index, str) and os.path.isabs(index) and plain_name(os.path.basename(index)) \
        and Path(index).parent.resolve() == tars.resolve()
    if not (plain_name(index) or beside_tars):
        raise bad(f"shard {name}: index {_shown(index)} is not a file name beside the manifest or the tars")


def load_index(root: str | Path, shard: dict[str, Any], fields: list[str] | None = None) -> dict[str, Any]:
    """The index of one shard (of a manifest :func:`load_manifest` checked), its structure and
    byte ranges checked before anything reads by them: the lists are numpy int64 arrays then.
    ``fields``: the manifest's (default: the index's own)."""
    path = Path(root) / shard["index"]
    try:
        index = parse_json(read_regular(path, "index"), "index", path)
    except ShardError as err:
        raise ShardError(f"index of shard {shard['name']}: {err}") from err
    if not isinstance(index, dict):
        raise ShardError(f"index {path} of shard {shard['name']} is {_shown(index)}, not an object; {_HINT}")
    check_index(path, shard, index, fields)
    return index


def check_index(path: Path, shard: dict[str, Any], index: dict[str, Any], fields: list[str] | None) -> None:
    """Types, counts and byte ranges of an index; its lists become int64 arrays in place."""
    def bad(what: str) -> ShardError:
        return ShardError(f"index {path} of shard {shard['name']}: {what}; {_HINT}")

    own = index.get("fields")
    if not isinstance(own, list) or not all(isinstance(f, str) for f in own) or (fields is not None and own != fields):
        raise bad(f"fields {_shown(own)} differ from the manifest's {fields}")
    keys = index.get("keys")
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise bad(f"'keys' is {_shown(keys)}, not a list of sample keys")
    if len(keys) != shard["samples"]:
        raise bad(f"it lists {len(keys)} samples, the manifest says {shard['samples']}")
    shapes = {"start": (len(keys),), "end": (len(keys),), "crc32": (len(keys),), "offsets": (len(keys), 2 * len(own))}
    for key, shape in shapes.items():
        index[key] = _int_array(index.get(key), shape, key, bad)
    _check_ranges(index, shard["bytes"], bad)


def _int_array(value: Any, shape: tuple[int, ...], key: str, bad: Any) -> np.ndarray:
    """``value`` as int64 of ``shape``; only whole numbers are accepted (numpy would cast floats and
    parse strings)."""
    if isinstance(value, list) and not value and shape[0] == 0:
        return np.zeros(shape, dtype=np.int64)
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError, OverflowError, RecursionError):  # ragged lists
        arr = np.zeros(0)
    if arr.dtype.kind not in "iu" or arr.shape != shape:
        raise bad(f"'{key}' is not a list of {shape[0]} whole numbers" + (f" x {shape[1]}" if len(shape) > 1 else ""))
    return arr.astype(np.int64)


def _check_ranges(index: dict[str, Any], declared: int, bad: Any) -> None:
    """Every sample's range lies within the shard's declared bytes, every field within its sample
    behind a tar header, every CRC-32 is 32 bits: no read by this index can be negative or huge."""
    start, end, keys = index["start"], index["end"], index["keys"]
    for wrong, what in ((start < 0, "starts before the file"), (end < start, "ends before it starts"),
                        (end > declared, f"ends past the {declared} bytes the manifest declares"),
                        ((index["crc32"] < 0) | (index["crc32"] >= 2**32), "has a CRC-32 that is not 32 bits")):
        if wrong.any():
            i = int(np.argmax(wrong))
            raise bad(f"sample {keys[i]!r} (bytes {int(start[i])}..{int(end[i])}) {what}")
    offsets = index["offsets"]
    if offsets.size:
        off, size, length = offsets[:, 0::2], offsets[:, 1::2], (end - start)[:, None]
        # no sum that could overflow int64: where off is out of range the row is already wrong
        wrong = ((off < BLOCK) | (size < 0) | (off > length) | (size > length - off)).any(axis=1)
        if wrong.any():
            i = int(np.argmax(wrong))
            raise bad(f"sample {keys[i]!r}: field offsets {offsets[i].tolist()} lie outside its "
                      f"{int(end[i] - start[i])} bytes")


def file_sha256(path: Path, chunk: int = 4 * 2**20) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            sha.update(block)
    return sha.hexdigest()


def summarize(root: str | Path) -> list[dict[str, Any]]:
    """Per split: samples, shards, bytes, fields, classes (for ``hpctrain data inspect``)."""
    out = []
    for path in sorted(Path(root).glob("*.manifest.json")):
        split = path.name[: -len(".manifest.json")]
        m = load_manifest(root, split)
        sizes = [s["bytes"] for s in m["shards"]] or [0]
        counts = [s["samples"] for s in m["shards"]] or [0]
        out.append({"split": split, "samples": sum(counts), "shards": len(m["shards"]),
                    "bytes": sum(sizes), "samples_per_shard": [min(counts), max(counts)],
                    "fields": m["fields"], "classes": m.get("classes", []), "source": m.get("source"),
                    "decode": m.get("decode")})
    return out
