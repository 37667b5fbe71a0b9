"""Tables users have: ``csv:PATH``, ``parquet:PATH``, ``jsonl:PATH`` (JSON lines) and ``hf:PATH``
(a Hugging Face dataset written by ``save_to_disk``), for ``train`` (``data.name=csv:PATH``) and
for ``hpctrain data shard``.

``PATH`` is one file (the training split; with ``data shard --split S``, split ``S``), or a
directory holding ``train.EXT`` and ``val.EXT`` (or ``validation.EXT``, ``test.EXT``); for
``hf:``, a saved ``Dataset`` (training split) or ``DatasetDict`` (its splits by name). Columns:
``data.label_column`` (``--label-column``, default ``label``) holds class ids 0..C-1;
``data.input_columns`` (``--input-column``, repeatable; default every numeric column but the
label) give one vector per row, or one column may hold a list per row (token ids, pixels).
Integer inputs stay integers (int64), floats are float32. The whole table is read into memory;
pyarrow (and datasets for ``hf:``) are optional packages, asked for with the pip command.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

from hpctrain.data.batch import ArrayDataset, as_model_input
from hpctrain.data.config import DataConfig
from hpctrain.data.errors import DataFormatError, MissingPackageError, ShardError
from hpctrain.data.files import jsonl_source
from hpctrain.data.pack import DEFAULT_PACK, PackOptions, PackSource, check_labels, labelled_samples, npy_bytes
from hpctrain.data.user import UserData

EXTENSIONS = {"csv": (".csv",), "parquet": (".parquet", ".pq"), "jsonl": (".jsonl", ".json", ".ndjson")}
SPLIT_NAMES = {"train": ("train",), "val": ("val", "validation", "valid"), "test": ("test",)}
Where = Callable[[int], str]


def _optional(module: str, package: str, kind: str) -> ModuleType:
    """An optional package, or a UserError (exit 2) with the pip command."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise MissingPackageError(f"{kind}: sources need {package}, which is not installed ({err}); "
                                  f"hint: pip install {package}") from None


# ---------------------------------------------------------------- finding and reading a split


def split_file(kind: str, path: str, split: str, *, single_is: str | None = "train") -> Path | None:
    """The file of ``split``: ``path`` itself when it is a file and ``split`` is ``single_is``
    (None: any split), or ``path/<split>.<ext>``; None when the directory has no such file."""
    base = Path(path)
    if base.is_file():
        return base if single_is is None or split == single_is else None
    if not base.is_dir():
        raise DataFormatError(f"{kind}:{path}: no such file or directory; hint: {kind}:FILE, or {kind}:DIR with "
                              f"train{EXTENSIONS[kind][0]} (and val{EXTENSIONS[kind][0]})")
    for name in SPLIT_NAMES[split]:
        for ext in EXTENSIONS[kind]:
            if (base / f"{name}{ext}").is_file():
                return base / f"{name}{ext}"
    return None


def read_table(kind: str, file: Path) -> Any:
    """The file as a ``pyarrow.Table``; a file that is not of ``kind`` is refused naming it."""
    pa_module = {"csv": "pyarrow.csv", "parquet": "pyarrow.parquet", "jsonl": "pyarrow.json"}[kind]
    reader = _optional(pa_module, "pyarrow", kind)
    read = {"csv": "read_csv", "parquet": "read_table", "jsonl": "read_json"}[kind]
    try:
        return getattr(reader, read)(str(file))
    except Exception as err:  # noqa: BLE001 - pyarrow's many errors all mean the file is not a readable table
        raise DataFormatError(f"{file} cannot be read as {kind}: {type(err).__name__}: {err}; hint: check the "
                              "file type (csv:, parquet:, jsonl:, hf: read those formats)") from None


def hf_splits(path: str) -> dict[str, Any]:
    """A ``save_to_disk`` directory: ``{split: Dataset}`` (a single Dataset is the training split)."""
    datasets = _optional("datasets", "datasets", "hf")
    try:
        loaded = datasets.load_from_disk(path)
    except (FileNotFoundError, ValueError, OSError) as err:
        raise DataFormatError(f"hf:{path} is not a dataset written by save_to_disk ({err}); hint: "
                              "datasets.Dataset.save_to_disk(PATH)") from None
    if isinstance(loaded, datasets.DatasetDict):
        return dict(loaded)
    return {"train": loaded}


def _hf_split(splits: dict[str, Any], split: str) -> Any:
    return next((splits[n] for n in SPLIT_NAMES[split] if n in splits), None)


def load_split_table(kind: str, path: str, split: str, *, single_is: str | None = "train") -> tuple[Any, str] | None:
    """``(pyarrow.Table, the file's name for messages)`` of ``split``, or None when there is none."""
    if kind == "hf":
        dataset = _hf_split(hf_splits(path), split)
        return None if dataset is None else (dataset.with_format("arrow")[:], f"hf:{path} ({split})")
    file = split_file(kind, path, split, single_is=single_is)
    return None if file is None else (read_table(kind, file), str(file))


# ---------------------------------------------------------------- columns to arrays


def columns_of(table: Any, name: str, inputs: list[str] | None, label: str) -> tuple[np.ndarray, np.ndarray]:
    """``(inputs, labels)`` arrays of a table; a missing or unusable column is refused naming it."""
    columns = list(table.column_names)
    for column in [*(inputs or []), label]:
        if column not in columns:
            setting = "data.label_column (--label-column)" if column == label else "data.input_columns (--input-column)"
            raise DataFormatError(f"{name} has no column {column!r}; its columns are {columns}; hint: set {setting}")
    chosen = inputs or [c for c in columns if c != label]
    if not chosen:
        raise DataFormatError(f"{name} has no input column besides {label!r}; hint: data.input_columns=[...]")
    arrays = [_column(table, name, c) for c in chosen]
    if len(arrays) == 1:
        x = arrays[0] if arrays[0].ndim > 1 else arrays[0][:, None]  # one feature: still a vector per row
    elif any(a.ndim != 1 for a in arrays):
        raise DataFormatError(f"{name}: columns {chosen} mix lists and single values; hint: one list column, "
                              "or several numeric columns (data.input_columns)")
    else:
        x = np.stack(arrays, axis=1)
    return x, _column(table, name, label)


def _column(table: Any, name: str, column: str) -> np.ndarray:
    """One column as a numeric array: numbers ``(N,)``, equal-length lists ``(N, L)``."""
    pa = _optional("pyarrow", "pyarrow", "table")

    data = table.column(column)
    kind = data.type
    nulls = data.null_count
    if nulls:
        row = next(i for i, v in enumerate(data.is_null().to_pylist()) if v)
        raise DataFormatError(f"{name}: column {column!r} is empty at row {row} ({nulls} empty values); hint: "
                              "fill or drop those rows")
    if pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind):
        return np.asarray(data.to_numpy())
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        rows = data.to_pylist()
        lengths = {len(r) for r in rows}
        if len(lengths) > 1:
            odd = next(i for i, r in enumerate(rows) if len(r) != len(rows[0]))
            raise DataFormatError(f"{name}: column {column!r} holds lists of different lengths (row 0: "
                                  f"{len(rows[0])}, row {odd}: {len(rows[odd])}); hint: pad or cut them to one length")
        return np.asarray(rows)
    raise DataFormatError(f"{name}: column {column!r} holds {kind}, not numbers or lists of numbers; hint: "
                          "tokenize or encode it first, name the numeric columns with data.input_columns, or give "
                          "your own dataset as data.name=package.module:NAME")


def _where(name: str, kind: str, label: str) -> Where:
    if kind == "csv":  # the header is line 1
        return lambda i: f"{name} line {i + 2} (column {label!r})"
    return lambda i: f"{name} row {i} (column {label!r})"


def labelled_arrays(kind: str, table: Any, name: str, inputs: list[str] | None, label: str,
                    num_classes: int | None) -> tuple[np.ndarray, np.ndarray, int]:
    """Inputs, int64 labels (checked: whole numbers in ``[0, num_classes)``) and the class count."""
    x, y = columns_of(table, name, inputs, label)
    count = check_labels(y, _where(name, kind, label), num_classes)
    return x, y.astype(np.int64), count


# ---------------------------------------------------------------- source hooks


def table_splits(data: DataConfig, arg: str, seed: int) -> UserData:
    """Source hook (``data.name=csv:PATH`` and the like): the splits in memory, labels checked."""
    kind = data.name.partition(":")[0]
    train = load_split_table(kind, arg, "train")
    if train is None:
        raise DataFormatError(f"{kind}:{arg} has no training split; hint: a file, or a directory with "
                              f"train{EXTENSIONS.get(kind, ('',))[0]}")
    x, y, count = labelled_arrays(kind, *train, data.input_columns, data.label_column, None)
    val_table = load_split_table(kind, arg, data.val_split)
    val = None
    if val_table is not None:
        vx, vy, _ = labelled_arrays(kind, *val_table, data.input_columns, data.label_column, count)
        val = _dataset(vx, vy, count, val_table[1])
    return UserData(data.name, _dataset(x, y, count, train[1]), val, count)


def _dataset(x: np.ndarray, y: np.ndarray, count: int, name: str) -> ArrayDataset:
    return ArrayDataset(as_model_input(torch.from_numpy(np.array(x))), torch.from_numpy(np.array(y)), count, name)


def _pack(kind: str, path: str, split: str, options: PackOptions) -> PackSource:
    """A split of a table as shards: each row's inputs as ``.npy``, its label as ``.cls``."""
    found = load_split_table(kind, path, split, single_is=None)
    if found is None:
        raise ShardError(f"{kind}:{path} has no {split} split; hint: a file, or a directory with "
                         f"{split}{EXTENSIONS.get(kind, ('',))[0]}")
    x, y, count = labelled_arrays(kind, *found, options.input_columns, options.label_column, options.num_classes)
    meta = {"source": f"{kind}:{path}", "classes": [str(i) for i in range(count)],
            "decode": {"input": "npy", "target": "cls"}}
    return labelled_samples(x, y, split, meta, "npy", npy_bytes)


def csv_pack(path: str, split: str, options: PackOptions = DEFAULT_PACK) -> PackSource:
    """Pack hook: ``hpctrain data shard csv:PATH``."""
    return _pack("csv", path, split, options)


def parquet_pack(path: str, split: str, options: PackOptions = DEFAULT_PACK) -> PackSource:
    """Pack hook: ``hpctrain data shard parquet:PATH``."""
    return _pack("parquet", path, split, options)


def hf_pack(path: str, split: str, options: PackOptions = DEFAULT_PACK) -> PackSource:
    """Pack hook: ``hpctrain data shard hf:PATH`` (a ``save_to_disk`` directory)."""
    return _pack("hf", path, split, options)


def jsonl_pack(path: str, split: str, options: PackOptions = DEFAULT_PACK) -> PackSource:
    """Pack hook: ``hpctrain data shard jsonl:PATH``: with ``--input-column``, a table like csv:;
    without, each record as ``.json`` and its ``label`` as ``.cls`` (as before)."""
    if options.input_columns:
        return _pack("jsonl", path, split, options)
    return jsonl_source(path, split, options)
