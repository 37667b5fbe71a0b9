"""Pack sources over the user's own files: ``imagefolder:PATH`` (a folder of images per class),
``npz:PATH`` (arrays and labels), ``jsonl:PATH`` (one JSON record per line)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from hpctrain.data.errors import ShardError
from hpctrain.data.manifest import IMAGE_EXTS
from hpctrain.data.pack import (
    DEFAULT_PACK,
    PackOptions,
    PackSource,
    Samples,
    cls_bytes,
    labelled_samples,
    npy_bytes,
    sample_key,
)


def imagefolder_source(root: str, split: str, options: PackOptions = DEFAULT_PACK) -> PackSource:
    """Source hook: ``ROOT/<class>/<image>``; the image bytes are stored as they are (no re-encoding)."""
    base = Path(root)
    if not base.is_dir():
        raise ShardError(f"imagefolder {root} is not a directory; hint: imagefolder:PATH with one subfolder per class")
    classes = sorted(p.name for p in base.iterdir() if p.is_dir())
    files = [(c, f) for c in classes for f in sorted((base / c).iterdir())
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
            yield sample_key(split, i), {"cls": cls_bytes(lookup[cls_name]), ext: file.read_bytes()}
    meta = {"source": f"imagefolder:{root}", "classes": classes,
            "decode": {"input": ext, "target": "cls", "scale": 255.0, "mean": None, "std": None}}
    return PackSource(gen(), len(files), meta)


def npz_source(path: str, split: str, options: PackOptions = DEFAULT_PACK) -> PackSource:
    """Source hook: arrays ``x``/``y`` (or ``images``/``labels``, or the first two) of an .npz file;
    raw .npy per sample."""
    data = np.load(path, allow_pickle=False)
    names = list(data.files)
    pick = next(((a, b) for a, b in (("x", "y"), ("images", "labels"), ("inputs", "targets"))
                 if a in names and b in names), tuple(names[:2]))
    if len(pick) != 2:
        raise ShardError(f"{path} needs two arrays (inputs, labels); it has {names}")
    x, y = data[pick[0]], data[pick[1]]
    if len(x) != len(y):
        raise ShardError(f"{path}: {pick[0]} has {len(x)} rows, {pick[1]} has {len(y)}")
    meta = {"source": f"npz:{path}", "classes": [str(i) for i in range(int(y.max()) + 1)],
            "decode": {"input": "npy", "target": "cls"}}
    return labelled_samples(x, y, split, meta, "npy", npy_bytes)


def jsonl_source(path: str, split: str, options: PackOptions = DEFAULT_PACK) -> PackSource:
    """Source hook: one JSON object per line; ``label`` (if present) becomes ``.cls``, the record ``.json``."""
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
            fields = {"cls": cls_bytes(rec["label"])} if has_label else {}
            fields["json"] = json.dumps(rec).encode()
            yield sample_key(split, i), fields
    classes = [str(i) for i in range(max(int(v) for v in labels if v is not None) + 1)] if has_label else []
    meta = {"source": f"jsonl:{path}", "classes": classes,
            "decode": {"input": "json", "target": "cls" if has_label else None}}
    return PackSource(gen(), len(records), meta)
