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
from pathlib import Path
from typing import Any

from hpctrain.data.errors import ShardError

FORMAT = "hpctrain-shards"
VERSION = 1
BLOCK = 512  # the tar block: headers and padded member data
IMAGE_EXTS = ("png", "jpg", "jpeg")
INPUT_EXTS = (*IMAGE_EXTS, "npy")
# Label fields, in the order they are looked for in tars written elsewhere: a text integer
# per sample (WebDataset's convention is .cls); the loader decodes them as int.
LABEL_EXTS = ("cls", "label", "target", "class", "cls2", "index")


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
        m = json.loads(path.read_text())
        sizes = [s["bytes"] for s in m["shards"]]
        counts = [s["samples"] for s in m["shards"]]
        out.append({"split": m["split"], "samples": m["total_samples"], "shards": len(sizes),
                    "bytes": sum(sizes), "samples_per_shard": [min(counts), max(counts)],
                    "fields": m["fields"], "classes": m.get("classes", []), "source": m.get("source"),
                    "decode": m.get("decode")})
    return out
