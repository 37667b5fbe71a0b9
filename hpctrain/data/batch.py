"""What the loaders yield (:class:`Batch`) and what the in-memory loaders read: an
:class:`ArrayDataset`, or any map-style ``torch.utils.data.Dataset`` of ``(input, target)``
items (wrapped in :class:`ItemDataset`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset, default_collate

from hpctrain.core.errors import UserError

ITEM_HINT = "hint: dataset[i] must return (input, target), e.g. (a tensor, an int class), or a dict of them"
INPUT_KEYS = ("input", "inputs", "input_ids", "x", "image", "img", "pixel_values", "features")  # dict items
LABEL_KEYS = ("label", "labels", "target", "targets", "y")
# What a dict item (or table row) carries beside its input that a model's forward takes by name
# (Hugging Face's): kept with the input, which then reaches the model as model(**inputs).
COMPANION_KEYS = ("attention_mask", "token_type_ids", "position_ids", "pixel_mask")
# What the targets must be (hpctrain.tasks: Task.targets): class ids, float values, 0/1 vectors,
# next tokens of unlabelled windows (the item is its input), or anything (a user's train.loss reads them).
TARGET_KINDS = ("class", "float", "multilabel", "tokens", "any")
ModelInput = Any  # a tensor, or a dict of named tensors the model takes as keywords (model(**inputs))


def main_input(inputs: ModelInput) -> torch.Tensor:
    """The tensor that stands for the inputs (their batch size, shape and dtype): itself, or a
    dict's first usual input key (input_ids, ...), else its first entry."""
    if not isinstance(inputs, Mapping):
        return inputs
    key = next((k for k in INPUT_KEYS if k in inputs), next(iter(inputs)))
    return inputs[key]


def map_inputs(inputs: ModelInput, fn: Callable[[torch.Tensor], torch.Tensor]) -> ModelInput:
    """``fn`` applied to the tensor, or to every tensor of a dict (keys and order kept)."""
    if isinstance(inputs, Mapping):
        return {k: fn(v) for k, v in inputs.items()}
    return fn(inputs)


def as_model_input(t: torch.Tensor) -> torch.Tensor:
    """The dtype a model takes: integers (token ids, integer features) as int64, for embeddings;
    uint8 (pixels), bool and every float as float32."""
    if t.is_floating_point() or t.dtype in (torch.uint8, torch.bool):
        return t if t.dtype == torch.float32 else t.float()
    return t if t.dtype == torch.int64 else t.long()


@dataclass
class Batch:
    """One batch: inputs (a tensor, or a dict of named tensors), targets (class ids, or what the
    task reads: float values, 0/1 vectors), and the sample keys (global indices or shard keys)."""

    inputs: ModelInput
    targets: torch.Tensor
    keys: torch.Tensor | list[str]
    mask: torch.Tensor | None = None  # 1 = real sample, 0 = padding that must not count

    def to(self, device: torch.device, non_blocking: bool = False) -> Batch:
        if device.type == "cpu":
            return self
        mask = None if self.mask is None else self.mask.to(device, non_blocking=non_blocking)
        return Batch(map_inputs(self.inputs, lambda t: t.to(device, non_blocking=non_blocking)),
                     self.targets.to(device, non_blocking=non_blocking), self.keys, mask)

    def pin_memory(self) -> Batch:
        return Batch(map_inputs(self.inputs, torch.Tensor.pin_memory), self.targets.pin_memory(), self.keys,
                     self.mask)

    def __len__(self) -> int:
        return int(self.targets.shape[0])


@dataclass
class PackedBatch:
    """A :class:`Batch` as a DataLoader worker sends it: numpy arrays and lists, pickled inline
    through the worker's pipe, made a Batch in the main process by :meth:`unpack`.

    Why: every torch tensor a worker returns travels as a fresh shared-memory segment whose file
    descriptor is handed over through a socket per tensor; on the 2-core VM that costs ~1-2 ms of
    CPU per tensor on each side (benchmarks/data_profile.py), more than decoding 64 small PNGs.
    ``convert`` (picklable) turns the stacked raw inputs (e.g. uint8 HWC pixels, a quarter of the
    float bytes) into the model's input; None: ``torch.from_numpy`` as they are.
    """

    inputs: Any  # np.ndarray; a tensor only where numpy has no such dtype (bfloat16)
    targets: list[int]
    keys: list[str]
    mask: list[bool] | None = None  # None: every slot is a real sample
    convert: Callable[[Any], torch.Tensor] | None = None

    def unpack(self) -> Batch:
        x = self.inputs
        if not isinstance(x, torch.Tensor):
            x = self.convert(x) if self.convert is not None else torch.from_numpy(x)
        mask = None if self.mask is None else torch.tensor(self.mask, dtype=torch.bool)
        return Batch(x, torch.tensor(self.targets, dtype=torch.int64), self.keys, mask)

    def pin_memory(self) -> Batch:
        """DataLoader's pin-memory thread calls this: the batch is unpacked there, off the main thread."""
        return self.unpack().pin_memory()


def _index(indices: list[int] | torch.Tensor) -> torch.Tensor:
    return indices if isinstance(indices, torch.Tensor) else torch.as_tensor(indices, dtype=torch.long)


class ArrayDataset(Dataset):
    """Images (float32, normalized, NCHW or NF) and labels in memory; ``inputs`` may also be a
    dict of named tensors (a table's input_ids and attention_mask), ``targets`` any tensor with
    the sample first (float values, 0/1 vectors).

    ``__getitems__`` lets a DataLoader fetch a whole batch with one tensor gather instead
    of one Python call and one collate per sample.
    """

    def __init__(self, inputs: ModelInput, targets: torch.Tensor, num_classes: int, name: str) -> None:
        if len(main_input(inputs)) != len(targets):
            raise ValueError(f"{name}: {len(main_input(inputs))} inputs but {len(targets)} targets")
        self.inputs, self.targets = inputs, targets
        self.num_classes, self.name = num_classes, name

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[Any, torch.Tensor]:
        return map_inputs(self.inputs, lambda t: t[index]), self.targets[index]

    def __getitems__(self, indices: list[int] | torch.Tensor) -> Batch:
        idx = _index(indices)
        return Batch(map_inputs(self.inputs, lambda t: t[idx]), self.targets[idx], idx)

    def subset(self, limit: int | None) -> ArrayDataset:
        if limit is None or limit >= len(self):
            return self
        return ArrayDataset(map_inputs(self.inputs, lambda t: t[:limit]), self.targets[:limit], self.num_classes,
                            self.name)

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(main_input(self.inputs).shape[1:])


@dataclass(frozen=True)
class ItemSpec:
    """How the items of a user's dataset become a :class:`Batch`."""

    name: str = "dataset"  # how messages name the dataset (e.g. "data.name=pkg.mod:make train")
    input_key: str | None = None  # dict items: the input's key (None: the first of INPUT_KEYS present)
    label_key: str | None = None  # dict items: the label's key (None: the first of LABEL_KEYS present)
    collate: Callable[[list[Any]], Any] | None = None  # items -> (inputs, targets) or a dict; default_collate if None
    num_classes: int | None = None  # labels are checked against [0, num_classes) when known
    labelled: bool = True  # False (token windows): an item is its input, targets are zeros
    targets: str = "class"  # what the labels must be (TARGET_KINDS)
    input_columns: tuple[str, ...] = ()  # dict items: the keys the model takes by name (data.input_columns)


class ItemDataset(Dataset):
    """Any map-style dataset of ``(input, target)`` items (or dicts, or with its own collate), read a
    batch at a time as a :class:`Batch`: inputs as a model takes them (:func:`as_model_input`),
    labels checked, the indices as keys. A bad item is a UserError naming its index."""

    def __init__(self, dataset: Dataset, spec: ItemSpec | None = None) -> None:
        self.dataset, self.spec = dataset, spec or ItemSpec(type(dataset).__name__)

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]  # batched() checked that it has one

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __getitems__(self, indices: list[int] | torch.Tensor) -> Batch:
        idx = _index(indices)
        ids = idx.tolist()
        # torch's own batched-fetch hook, when the dataset has one (Subset, StackDataset, HF datasets, ...)
        fetch = getattr(self.dataset, "__getitems__", None)
        items = fetch(ids) if fetch is not None else [self.dataset[i] for i in ids]
        return self.collate(list(items), idx)

    def collate(self, items: list[Any], keys: torch.Tensor) -> Batch:
        """Items (as ``dataset[i]`` gives them) as one batch; ``keys``: their sample ids."""
        spec = self.spec
        if spec.collate is not None:
            inputs, targets = self._pair(_user_collate(spec, items, keys),
                                         f"data.collate's result for samples {keys[:4].tolist()}")
        else:
            pairs = [self._pair(item, f"{spec.name}[{key}]") for key, item in zip(keys.tolist(), items)]
            inputs, targets = self._stack([p[0] for p in pairs], keys), default_collate([p[1] for p in pairs])
        if not (isinstance(inputs, torch.Tensor) or _tensor_dict(inputs)):
            raise UserError(f"{spec.name}: samples {keys[:4].tolist()} collate to inputs of type "
                            f"{type(inputs).__name__}, not a tensor (or a dict of tensors); {ITEM_HINT}")
        targets = torch.as_tensor(targets) if spec.labelled else torch.zeros(len(keys), dtype=torch.int64)
        return Batch(map_inputs(inputs, as_model_input), check_targets(targets, keys, spec), keys)

    def _pair(self, item: Any, where: str) -> tuple[Any, Any]:
        """(input, target) of one item, or of what data.collate returned."""
        if isinstance(item, Mapping):
            return _dict_inputs(item, self.spec, where), (
                item[_key(item, self.spec.label_key, LABEL_KEYS, "label", where)] if self.spec.labelled else 0)
        if isinstance(item, (tuple, list)) and len(item) == 2:
            return item[0], item[1]
        if not self.spec.labelled and isinstance(item, torch.Tensor):
            return item, 0
        raise UserError(f"{where} is a {type(item).__name__}, not an (input, target) pair; {ITEM_HINT}")

    def _stack(self, inputs: list[Any], keys: torch.Tensor) -> Any:
        try:
            return default_collate(inputs)
        except (RuntimeError, TypeError) as err:  # inputs of different shapes or of no tensor type
            shapes = sorted({str(tuple(x.shape)) if hasattr(x, "shape") else type(x).__name__ for x in inputs})
            raise UserError(f"{self.spec.name}: samples {keys[:4].tolist()}... do not stack into one batch "
                            f"({', '.join(shapes[:4])}): {err}; hint: give every sample one shape (resize or pad "
                            "in the dataset), or pass data.collate=pkg.mod:fn") from None


def _user_collate(spec: ItemSpec, items: list[Any], keys: torch.Tensor) -> Any:
    """data.collate's result; an exception in it is the user's, named (exit 2), not hpctrain's."""
    assert spec.collate is not None
    try:
        return spec.collate(items)
    except UserError:
        raise
    except Exception as err:  # noqa: BLE001 - user code: their message, with the key that named it
        raise UserError(f"data.collate raised {type(err).__name__}: {err} (samples {keys[:4].tolist()}); hint: call "
                        "it yourself on a few dataset items to see the traceback") from None


def _tensor_dict(value: Any) -> bool:
    return isinstance(value, Mapping) and bool(value) and all(isinstance(v, torch.Tensor) for v in value.values())


def _dict_inputs(item: Mapping[str, Any], spec: ItemSpec, where: str) -> Any:
    """A dict item's (or a dict collate's) inputs: the keys of data.input_columns as a dict; else
    the input key's value, joined by the companions present (attention_mask, ...) as a dict; a
    dict with no usual input key: every key but the label."""
    if spec.input_columns:
        missing = [k for k in spec.input_columns if k not in item]
        if missing:
            raise UserError(f"{where} has no key {missing[0]!r}; it has {sorted(map(str, item))}; hint: check "
                            "data.input_columns")
        return {k: item[k] for k in spec.input_columns}
    if spec.input_key is None and not any(k in item for k in INPUT_KEYS) and len(item) > 2:
        label = next((k for k in (spec.label_key, *LABEL_KEYS) if k is not None and k in item), None)
        if label is not None and spec.labelled:
            return {k: v for k, v in item.items() if k != label}
    key = _key(item, spec.input_key, INPUT_KEYS, "input", where)
    companions = [k for k in COMPANION_KEYS if k in item and k != key]
    if not companions:
        return item[key]
    return {key: item[key], **{k: item[k] for k in companions}}


def _key(item: Mapping[str, Any], chosen: str | None, candidates: tuple[str, ...], what: str, where: str) -> str:
    """The key of a dict item's input or label: the configured one, else the first usual name present."""
    if chosen is not None and chosen in item:
        return chosen
    found = None if chosen is not None else next((k for k in candidates if k in item), None)
    if found is None:
        setting = f"data.{what}_key"
        said = f"has no key {chosen!r}" if chosen is not None else f"has none of the usual {what} keys {candidates}"
        raise UserError(f"{where} {said}; it has {sorted(map(str, item))}; hint: set {setting}=KEY")
    return found


def check_targets(targets: torch.Tensor, keys: torch.Tensor, spec: ItemSpec) -> torch.Tensor:
    """The batch's targets as the task reads them (``spec.targets``): class ids (checked), float
    values (float32, any shape), 0/1 vectors (float32, checked), or as they are (``any``)."""
    if spec.targets == "float":
        if targets.dtype == torch.bool or targets.is_complex():
            raise UserError(f"{spec.name}: targets of dtype {targets.dtype}; regression needs numbers; hint: "
                            "data.label_key (data.label_column for tables) names the target")
        return targets.float()
    if spec.targets == "multilabel":
        return multilabel_targets(targets, keys, spec)
    if spec.targets in ("any", "tokens"):
        return targets
    return class_targets(targets, keys, spec)


def multilabel_targets(targets: torch.Tensor, keys: torch.Tensor, spec: ItemSpec) -> torch.Tensor:
    """0/1 vectors, one per sample (float32 for BCE); the first bad sample is refused, named."""
    if targets.ndim != 2:
        raise UserError(f"{spec.name}: samples {keys[:4].tolist()} have targets of shape "
                        f"{tuple(targets.shape[1:])}; multilabel needs one 0/1 vector per sample; hint: "
                        "data.label_key names it (tables: data.label_columns=[a,b,...] or a list column)")
    if spec.num_classes is not None and targets.shape[1] != spec.num_classes:
        raise UserError(f"{spec.name}: targets have {targets.shape[1]} labels, not {spec.num_classes}; hint: "
                        "every sample has one 0/1 value per label")
    bad = torch.nonzero(((targets != 0) & (targets != 1)).any(1)).flatten()
    if len(bad):
        i = int(bad[0])
        raise UserError(f"{spec.name}[{int(keys[i])}] has targets {targets[i].tolist()[:8]}, not 0/1 values; hint: "
                        "multilabel targets mark each label present (1) or absent (0)")
    return targets.float()


def class_targets(targets: torch.Tensor, keys: torch.Tensor, spec: ItemSpec) -> torch.Tensor:
    """Labels as int64 class ids: one whole number per sample in ``[0, num_classes)``; the first bad
    one is refused naming its sample (a float label would be truncated, a negative one crash the loss)."""
    if targets.ndim != 1:
        raise UserError(f"{spec.name}: samples {keys[:4].tolist()} have labels of shape {tuple(targets.shape[1:])}; "
                        "classification needs one class id per sample; hint: data.label_key names the label; "
                        "train.task=multilabel for 0/1 vectors, train.task=regression for float values")
    if targets.is_floating_point():
        bad = torch.nonzero(targets != targets.round()).flatten()
        if len(bad):
            i = int(bad[0])
            raise UserError(f"{spec.name}[{int(keys[i])}] has label {targets[i].item()!r}, not a whole number: "
                            "classification needs class ids 0..C-1; hint: train.task=regression for float targets")
    elif targets.dtype == torch.bool or targets.is_complex():
        raise UserError(f"{spec.name}: labels of dtype {targets.dtype}; hint: class ids 0..C-1 as integers")
    targets = targets.long()
    high = spec.num_classes
    outside = targets < 0 if high is None else (targets < 0) | (targets >= high)
    bad = torch.nonzero(outside).flatten()
    if len(bad):
        i = int(bad[0])
        limit = f"[0, {high})" if high is not None else "0 or more"
        raise UserError(f"{spec.name}[{int(keys[i])}] has label {int(targets[i])}, outside {limit}; hint: class ids "
                        "run from 0 to num_classes - 1 (model.num_classes, or num_classes in the data mapping)")
    return targets


BatchedDataset = ArrayDataset | ItemDataset  # what the in-memory loaders read: __getitems__ gives a Batch


def batched(dataset: Dataset, spec: ItemSpec | None = None) -> BatchedDataset:
    """The dataset as the loaders read it: an ArrayDataset as it is (one tensor gather per batch),
    any other map-style dataset wrapped in :class:`ItemDataset`."""
    if isinstance(dataset, (ArrayDataset, ItemDataset)):
        return dataset
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
        raise UserError(f"{type(dataset).__name__} is not a map-style dataset (len(dataset) and dataset[i]); "
                        "hint: hpctrain's loaders split samples by index over ranks; wrap an iterable stream "
                        "in tar shards (`hpctrain data shard`) instead")
    return ItemDataset(dataset, spec)


def pass_batch(batch: Batch) -> Batch:
    """collate_fn for datasets whose ``__getitems__`` already returns a Batch (picklable)."""
    return batch
