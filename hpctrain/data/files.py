"""Pack sources over the user's own files: ``imagefolder:PATH`` (a folder of images per class),
``npz:PATH`` (arrays and labels), ``jsonl:PATH`` (one JSON record per line).

A jsonl file is read through the bounded open a line at a time (:func:`jsonl_lines`): each line
is UTF-8 and at most the document limit (:func:`~hpctrain.data.pack.document_limit`), else it is
refused naming the file and the line."""

from __future__ import annotations

import io
import json
import logging
import zipfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from hpctrain.core.safe_open import NotRegularError, open_regular
from hpctrain.data.errors import DataMissingError, ShardError
from hpctrain.data.manifest import IMAGE_EXTS
from hpctrain.data.pack import (
    DEFAULT_PACK,
    PackOptions,
    PackSource,
    Samples,
    check_document_size,
    check_labels,
    cls_bytes,
    document_limit,
    labelled_samples,
    npy_bytes,
    pillow,
    sample_key,
)

log = logging.getLogger("hpctrain")
Look = tuple[tuple[int, int], str]  # an image's (width, height) as PIL gives it, and "L" (gray) or "RGB"


def imagefolder_source(root: str, split: str, options: PackOptions = DEFAULT_PACK) -> PackSource:
    """Source hook: ``ROOT/<class>/<image>``. Labels number the class names (another split's, when
    ``options.classes`` gives them). Every image is decoded once here: an unreadable one is refused,
    and all must share one size (or are resized to ``options.image_size``) and one mode (the
    minority of gray/RGB is converted to the majority). Images that need neither are stored
    byte for byte."""
    base = Path(root)
    if not base.is_dir():
        raise ShardError(f"imagefolder {root} is not a directory; hint: imagefolder:PATH with one subfolder per class")
    image = pillow()  # before any work: without Pillow nothing can be checked or read back
    classes = _class_names(root, split, sorted(p.name for p in base.iterdir() if p.is_dir()), options)
    files = [(c, f) for c in classes if (base / c).is_dir() for f in sorted((base / c).iterdir())
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
    looks = [_look(image, file) for _, file in files]
    target = _target_look(root, looks, [f for _, f in files], options.image_size)

    def gen() -> Samples:
        for i, (cls_name, file) in enumerate(files):
            data = file.read_bytes()
            if looks[i] != target:
                data = _reencode(image, data, target, ext)
            yield sample_key(split, i), {"cls": cls_bytes(lookup[cls_name]), ext: data}
    meta = {"source": f"imagefolder:{root}", "classes": classes,
            "decode": {"input": ext, "target": "cls", "scale": 255.0, "mean": None, "std": None}}
    return PackSource(gen(), len(files), meta)


def _class_names(root: str, split: str, found: list[str], options: PackOptions) -> list[str]:
    """The class list whose positions are the labels: this folder's, or the other split's
    (``options.classes``) so that a name has one label in every split."""
    known = options.classes
    if known is None:
        return found
    extra = sorted(set(found) - set(known))
    if extra:
        raise ShardError(f"imagefolder {root} (split {split}) has class folders {extra} that the other split "
                         f"does not ({len(known)} classes: {', '.join(known[:8])}{' ...' if len(known) > 8 else ''}); "
                         "hint: shard the split with every class first (train), or write to another directory")
    missing = sorted(set(known) - set(found))
    if missing and not options.allow_missing_classes:
        raise ShardError(f"imagefolder {root} (split {split}) lacks class folders {missing} that the other split "
                         "has; labels follow class names, so this split would be numbered differently; hint: "
                         "--allow-missing-classes writes it anyway, numbered as the other split")
    return list(known)


def _look(image: ModuleType, file: Path) -> Look:
    """Size and mode of one image, decoded in full (a truncated file fails here, not mid-run)."""
    try:
        with image.open(file) as img:
            img.load()
            return img.size, "L" if img.mode == "L" else "RGB"  # the loader's decode_image gives gray or RGB
    except Exception as err:  # noqa: BLE001 - PIL raises many kinds for a bad file; each is the file's fault
        raise ShardError(f"image {file} cannot be read: {type(err).__name__}: {err}; "
                         "hint: delete or replace the file, then shard again") from err


def _target_look(root: str, looks: list[Look], files: list[Path], image_size: int | None) -> Look:
    """The one size and mode every image is stored at: ``image_size`` (or the only size there is)
    and the majority mode (RGB on a tie: no colour is lost)."""
    modes = Counter(mode for _, mode in looks)
    mode = "L" if modes["L"] > modes["RGB"] else "RGB"
    sizes = Counter(size for size, _ in looks)
    if len(sizes) > 1 and image_size is None:
        (common, n), (odd, _) = sizes.most_common(1)[0], sizes.most_common()[-1]
        file = files[next(i for i, (size, _) in enumerate(looks) if size == odd)]
        raise ShardError(f"imagefolder {root} mixes image sizes: {n} images are {common[0]}x{common[1]}, {file} is "
                         f"{odd[0]}x{odd[1]} ({len(sizes)} sizes, width x height); hint: --image-size N "
                         "(data.image_size=N) resizes every image to N x N")
    if len(modes) > 1:
        log.warning("imagefolder %s mixes grayscale and RGB images: converting %d to %s, the majority mode",
                    root, len(looks) - modes[mode], mode)
    return ((image_size, image_size) if image_size else next(iter(sizes))), mode


def _reencode(image: ModuleType, data: bytes, look: Look, ext: str) -> bytes:
    """``data`` converted to ``look``'s mode and size, in its own format (JPEG at quality 95)."""
    size, mode = look
    with image.open(io.BytesIO(data)) as img:
        out = img.convert(mode)
        if out.size != size:
            out = out.resize(size, image.Resampling.BILINEAR)
    buf = io.BytesIO()
    out.save(buf, format="PNG" if ext == "png" else "JPEG", **({} if ext == "png" else {"quality": 95}))
    return buf.getvalue()


def _load_npz(path: str) -> Any:
    """The arrays of an .npz, or a ShardError saying what the file is instead (a CSV, a pickle)."""
    try:
        return np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as err:
        if isinstance(err, FileNotFoundError):
            raise
        # numpy's own message for a text file speaks of pickled data: not what the user needs to hear
        raise ShardError(f"{path} is not an .npz file (the zip of arrays numpy.savez writes) that npz: reads; "
                         f"hint: save it with numpy.savez(PATH, x=inputs, y=labels), or use the source for its "
                         f"format (`hpctrain data shard --help` lists them)") from err


def npz_source(path: str, split: str, options: PackOptions = DEFAULT_PACK) -> PackSource:
    """Source hook: arrays ``x``/``y`` (or ``images``/``labels``, or the first two) of an .npz file;
    raw .npy per sample."""
    data = _load_npz(path)
    names = list(data.files)
    pick = next(((a, b) for a, b in (("x", "y"), ("images", "labels"), ("inputs", "targets"))
                 if a in names and b in names), tuple(names[:2]))
    if len(pick) != 2:
        raise ShardError(f"{path} needs two arrays (inputs, labels); it has {names}")
    x, y = data[pick[0]], data[pick[1]]
    if len(x) != len(y):
        raise ShardError(f"{path}: {pick[0]} has {len(x)} rows, {pick[1]} has {len(y)}")
    count = check_labels(y, lambda i: f"{path}: sample {i} ({pick[1]}[{i}])", options.num_classes)
    meta = {"source": f"npz:{path}", "classes": [str(i) for i in range(count)],
            "decode": {"input": "npy", "target": "cls"}}
    return labelled_samples(x, y, split, meta, "npy", npy_bytes)


def jsonl_source(path: str, split: str, options: PackOptions = DEFAULT_PACK) -> PackSource:
    """Source hook: one JSON object per line; ``label`` (if present) becomes ``.cls``, the record ``.json``."""
    records = []
    for n, line in jsonl_lines(path):
        try:
            records.append(json.loads(line))
        except (ValueError, RecursionError) as err:  # bad JSON, a 5000-digit number, deep nesting
            raise ShardError(f"{path} line {n} is not JSON: {str(err)[:200]}") from None
    labels = [r.get("label") if isinstance(r, dict) else None for r in records]
    has_label = any(v is not None for v in labels)
    count = _jsonl_classes(path, labels, options.num_classes) if has_label else 0

    def gen() -> Samples:
        for i, rec in enumerate(records):
            fields = {"cls": cls_bytes(rec["label"])} if has_label else {}
            fields["json"] = json.dumps(rec).encode()
            yield sample_key(split, i), fields
    classes = [str(i) for i in range(count)]
    meta = {"source": f"jsonl:{path}", "classes": classes,
            "decode": {"input": "json", "target": "cls" if has_label else None}}
    return PackSource(gen(), len(records), meta)


def jsonl_lines(path: str | Path) -> Iterator[tuple[int, str]]:
    """``(line number, text)`` of each non-blank line of a jsonl file, read a line at a time through
    the bounded open: a line longer than the document limit, or not UTF-8, is refused naming the
    file and the line (never a UnicodeDecodeError, never a read of a whole huge line)."""
    limit = document_limit()
    try:
        raw, _ = open_regular(path)
    except NotRegularError as err:
        raise ShardError(f"{path} is a {err.kind}, not a regular file; hint: jsonl:FILE names a file of JSON "
                         "lines") from None
    except FileNotFoundError:
        raise DataMissingError(f"{path} does not exist; hint: jsonl:FILE names a file of JSON lines") from None
    except OSError as err:
        raise ShardError(f"{path} cannot be read: {err.strerror}") from None
    with io.BufferedReader(raw) as fh:
        for n, line in enumerate(iter(lambda: fh.readline(limit + 1), b""), 1):
            if len(line) > limit and not line.endswith(b"\n"):
                check_document_size(f"{path} line {n}", None)  # refuses: read no further than the limit
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ShardError(f"{path} line {n} is not UTF-8 text ({err.reason}, byte {err.start + 1} of the "
                                 "line); hint: write the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None
            if text.strip():
                yield n, text


def _jsonl_classes(path: str, labels: list[Any], num_classes: int | None) -> int:
    """Labelled records: every line has a whole-number ``label`` in range (checked by line); the class count."""
    def where(i: int) -> str:
        return f"{path} record {i + 1}"
    for i, v in enumerate(labels):
        if v is None or isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ShardError(f"{where(i)} has label {v!r}, not a class id, while other lines have labels; "
                             "hint: every record needs an integer 'label' (0..C-1), or none does")
    return check_labels(labels, where, num_classes)
