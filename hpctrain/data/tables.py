"""Tables users have: ``csv:PATH``, ``parquet:PATH``, ``jsonl:PATH`` (JSON lines) and ``hf:PATH``
(a Hugging Face dataset written by ``save_to_disk``), for ``train`` (``data.name=csv:PATH``) and
for ``hpctrain data shard``.

``PATH`` is one file (the training split; with ``data shard --split S``, split ``S``), or a
directory holding ``train.EXT`` and ``val.EXT`` (or ``validation.EXT``, ``test.EXT``); for
``hf:``, a saved ``Dataset`` (training split) or ``DatasetDict`` (its splits by name). Columns:
``data.label_column`` (``--label-column``, default ``label``) holds the targets: class ids
0..C-1, or for ``train.task=regression`` numbers (a list per row: a vector), for ``multilabel``
a 0/1 list per row; ``data.label_columns=[a,b]`` stacks several numeric columns into one
target vector per row. ``data.input_columns`` (``--input-column``, repeatable; default every
numeric column but the targets, text columns skipped) give one vector per row, or one column may
hold a list per row (token ids, pixels); several columns of which one holds lists (``input_ids``,
``attention_mask``, ``token_type_ids``) become a dict of named tensors, which the model takes
as ``model(**inputs)``. Integer inputs stay integers (int64), floats are float32. The whole
table is read into memory; pyarrow (and datasets for ``hf:``) are optional packages, asked for
with the pip command. ``hpctrain data shard`` packs class ids only.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

from hpctrain.config.data import DataConfig
from hpctrain.data.batch import INPUT_KEYS, ArrayDataset, as_model_input, map_inputs
from hpctrain.data.errors import DataFormatError, MissingPackageError, ShardError
from hpctrain.data.files import jsonl_lines, jsonl_source
from hpctrain.data.pack import DEFAULT_PACK, PackOptions, PackSource, check_labels, labelled_samples, npy_bytes
from hpctrain.data.packed import table_documents_pack
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
    # jsonl: every line checked first (UTF-8, the document limit; named by line, which pyarrow
    # cannot: it reads bytes unchecked and skips blank lines), and blocks that hold the longest
    options = {"read_options": reader.ReadOptions(block_size=_jsonl_block(file))} if kind == "jsonl" else {}
    try:
        return getattr(reader, read)(str(file), **options)
    except Exception as err:  # noqa: BLE001 - pyarrow's many errors all mean the file is not a readable table
        raise DataFormatError(f"{file} cannot be read as {kind}: {type(err).__name__}: {err}; hint: check the "
                              "file type (csv:, parquet:, jsonl:, hf: read those formats)") from None


def _jsonl_block(file: Path) -> int:
    """pyarrow's JSON block size for ``file``: one that holds its longest line (a record straddling
    two blocks is an error there), at least pyarrow's default 1 MiB."""
    return max(1 << 20, max((len(line.encode()) for _, line in jsonl_lines(file)), default=0) + 1)


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
            raise _no_column(table, name, column, column == label)
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


def _no_column(table: Any, name: str, column: str, is_label: bool) -> DataFormatError:
    """A missing column, named. A table without labels whose columns hold text is most likely a
    corpus for a language model: the hint says how to train on it that way."""
    columns = list(table.column_names)
    setting = "data.label_column (--label-column)" if is_label else "data.input_columns (--input-column)"
    text = [c for c in columns if _is_text(table, c)] if is_label else []
    lm = (f", or train a language model on its text column {text[0]!r}: train.task=causal_lm "
          f"data.input_key={text[0]}") if text else ""
    return DataFormatError(f"{name} has no column {column!r}; its columns are {columns}; hint: set {setting}{lm}")


def _is_text(table: Any, column: str) -> bool:
    pa = _optional("pyarrow", "pyarrow", "table")
    kind = table.schema.field(column).type
    return bool(pa.types.is_string(kind) or pa.types.is_large_string(kind))


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


# ---------------------------------------------------------------- a run's tables: any target, named inputs

Inputs = np.ndarray | dict[str, np.ndarray]


def _numeric(table: Any, column: str) -> bool:
    pa = _optional("pyarrow", "pyarrow", "table")
    kind = table.schema.field(column).type
    while pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        kind = kind.value_type
    return bool(pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind))


def run_inputs(kind: str, table: Any, name: str, inputs: list[str] | None, labels: list[str]) -> Inputs:
    """The inputs of a run's table: one array (numbers stacked into a vector per row, or one
    list column), or, for several columns with lists among them, a dict by column name."""
    columns = list(table.column_names)
    for column in [*(inputs or []), *labels]:
        if column not in columns:
            raise _no_column(table, name, column, column in labels)
    # hf: a tokenized dataset keeps its text column beside the token ids: skipped by default there;
    # elsewhere a text column is refused, named (it is likely a feature not yet encoded)
    chosen = inputs or [c for c in columns if c not in labels and (kind != "hf" or _numeric(table, c))]
    if not chosen:
        raise DataFormatError(f"{name} has no numeric input column besides {labels}; hint: tokenize text columns "
                              "first, or name them with data.input_columns=[...]")
    arrays = {c: _column(table, name, c) for c in chosen}
    if len(arrays) > 1 and any(a.ndim > 1 for a in arrays.values()):
        first = next((k for k in INPUT_KEYS if k in arrays), chosen[0])  # the main input first
        return {first: arrays[first], **{k: v for k, v in arrays.items() if k != first}}
    if len(arrays) == 1:
        only = arrays[chosen[0]]
        return only if only.ndim > 1 else only[:, None]  # one feature: still a vector per row
    return np.stack(list(arrays.values()), axis=1)


def run_targets(kind: str, table: Any, name: str, labels: list[str], targets: str,
                num_classes: int | None) -> tuple[np.ndarray, int | None]:
    """The targets as ``targets`` (the task's kind) wants them and the class count (None: not
    class ids): class ids checked, float values, 0/1 vectors checked, or as they are (``any``)."""
    arrays = [_column(table, name, c) for c in labels]
    y = arrays[0] if len(arrays) == 1 else np.stack(arrays, axis=1)
    where = _where(name, kind, labels[0] if len(labels) == 1 else str(labels))
    if targets == "any" and y.ndim == 1 and y.dtype.kind in "iu":  # class ids, unchecked: train.loss reads them
        return y.astype(np.int64), num_classes or (int(y.max()) + 1 if len(y) else 0)
    if targets == "class":
        if y.ndim != 1:
            raise DataFormatError(f"{name}: {labels} hold {y.shape[1:]} values per row; classification needs one "
                                  "class id per row; hint: train.task=multilabel for 0/1 vectors, "
                                  "train.task=regression for values")
        fractional = np.flatnonzero(y != np.round(y)) if y.dtype.kind == "f" else np.zeros(0, dtype=np.int64)
        if len(fractional):
            i = int(fractional[0])
            raise DataFormatError(f"{where(i)} has label {y[i].item()!r}, not a whole number: classification needs "
                                  "class ids 0..C-1; hint: train.task=regression for float targets")
        return y.astype(np.int64), check_labels(y, where, num_classes)
    if targets == "multilabel":
        if y.ndim != 2 or not bool(np.isin(y, (0, 1)).all()):
            bad = 0 if y.ndim != 2 else int(np.flatnonzero(~np.isin(y, (0, 1)).all(1))[0])
            raise DataFormatError(f"{where(bad)}: multilabel needs a 0/1 vector per row; hint: a list column, or "
                                  "data.label_columns=[a,b,...] naming 0/1 columns")
        return y.astype(np.float32), None
    if y.dtype.kind == "b" or targets == "float":
        return y.astype(np.float32), None
    return (y.astype(np.float32) if y.dtype.kind == "f" else y), None


def target_width(y: np.ndarray) -> int:
    """Values per sample: what a model predicting the targets outputs (num_classes for its factory)."""
    return int(np.prod(y.shape[1:])) if y.ndim > 1 else 1


# ---------------------------------------------------------------- source hooks


def table_splits(data: DataConfig, arg: str, seed: int, targets: str = "class") -> UserData:
    """Source hook (``data.name=csv:PATH`` and the like): the splits in memory, targets as
    ``targets`` (the task's kind) wants them."""
    kind = data.name.partition(":")[0]
    train = load_split_table(kind, arg, "train")
    if train is None:
        raise DataFormatError(f"{kind}:{arg} has no training split; hint: a file, or a directory with "
                              f"train{EXTENSIONS.get(kind, ('',))[0]}")
    labels = list(data.label_columns or [data.label_column])
    x = run_inputs(kind, *train, data.input_columns, labels)
    y, count = run_targets(kind, *train, labels, targets, None)
    width = count if count is not None else target_width(y)
    val_table = load_split_table(kind, arg, data.val_split)
    val = None
    if val_table is not None:
        vx = run_inputs(kind, *val_table, data.input_columns, labels)
        vy, _ = run_targets(kind, *val_table, labels, targets, count)
        val = _dataset(vx, vy, width, val_table[1])
    return UserData(data.name, _dataset(x, y, width, train[1]), val, width)


def _dataset(x: Inputs, y: np.ndarray, count: int, name: str) -> ArrayDataset:
    inputs = map_inputs(x, lambda a: as_model_input(torch.from_numpy(np.array(a))))
    return ArrayDataset(inputs, torch.from_numpy(np.array(y)), count, name)


def _pack(kind: str, path: str, split: str, options: PackOptions) -> PackSource:
    """A split of a table as shards: each row's inputs as ``.npy``, its label as ``.cls``; with
    ``--packing documents``, its text column as packed documents (:mod:`hpctrain.data.packed`)."""
    found = load_split_table(kind, path, split, single_is=None)
    if found is None:
        raise ShardError(f"{kind}:{path} has no {split} split; hint: a file, or a directory with "
                         f"{split}{EXTENSIONS.get(kind, ('',))[0]}")
    if options.packing == "documents":
        return table_documents_pack(*found, split, options, f"{kind}:{path}")
    if options.tokenizer:
        raise ShardError(f"--tokenizer tokenizes text, but {kind}:{path} is sharded as inputs and labels; hint: "
                         "--packing documents packs its text column (--input-column NAME) as a language model's")
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
    """Pack hook: ``hpctrain data shard jsonl:PATH``: with ``--input-column`` (or ``--packing
    documents``), a table like csv:; without, each record as ``.json`` and its ``label`` as ``.cls`` (as before)."""
    if options.input_columns or options.packing == "documents" or options.tokenizer:
        return _pack("jsonl", path, split, options)
    return jsonl_source(path, split, options)
