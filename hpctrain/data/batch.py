"""What the loaders yield (:class:`Batch`) and what the in-memory loaders read: an
:class:`ArrayDataset`, or any map-style ``torch.utils.data.Dataset`` of ``(input, target)``
items (wrapped in :class:`ItemDataset`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset, default_collate

from hpctrain.errors import UserError

ITEM_HINT = "hint: dataset[i] must return (input, target), e.g. (a tensor, an int class), or a dict of them"
INPUT_KEYS = ("input", "inputs", "input_ids", "x", "image", "img", "pixel_values", "features")  # dict items
LABEL_KEYS = ("label", "labels", "target", "targets", "y")


def as_model_input(t: torch.Tensor) -> torch.Tensor:
    """The dtype a model takes: integers (token ids, integer features) as int64, for embeddings;
    uint8 (pixels), bool and every float as float32."""
    if t.is_floating_point() or t.dtype in (torch.uint8, torch.bool):
        return t if t.dtype == torch.float32 else t.float()
    return t if t.dtype == torch.int64 else t.long()


@dataclass
class Batch:
    """One batch: inputs, integer targets, and the sample keys (global indices or shard keys)."""

    inputs: torch.Tensor
    targets: torch.Tensor
    keys: torch.Tensor | list[str]
    mask: torch.Tensor | None = None  # 1 = real sample, 0 = padding that must not count

    def to(self, device: torch.device, non_blocking: bool = False) -> Batch:
        if device.type == "cpu":
            return self
        mask = None if self.mask is None else self.mask.to(device, non_blocking=non_blocking)
        return Batch(self.inputs.to(device, non_blocking=non_blocking),
                     self.targets.to(device, non_blocking=non_blocking), self.keys, mask)

    def pin_memory(self) -> Batch:
        return Batch(self.inputs.pin_memory(), self.targets.pin_memory(), self.keys, self.mask)

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
    """Images (float32, normalized, NCHW or NF) and labels in memory.

    ``__getitems__`` lets a DataLoader fetch a whole batch with one tensor gather instead
    of one Python call and one collate per sample.
    """

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor, num_classes: int, name: str) -> None:
        if len(inputs) != len(targets):
            raise ValueError(f"{name}: {len(inputs)} inputs but {len(targets)} targets")
        self.inputs, self.targets = inputs, targets
        self.num_classes, self.name = num_classes, name

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[index], self.targets[index]

    def __getitems__(self, indices: list[int] | torch.Tensor) -> Batch:
        idx = _index(indices)
        return Batch(self.inputs[idx], self.targets[idx], idx)

    def subset(self, limit: int | None) -> ArrayDataset:
        if limit is None or limit >= len(self):
            return self
        return ArrayDataset(self.inputs[:limit], self.targets[:limit], self.num_classes, self.name)

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.inputs.shape[1:])


@dataclass(frozen=True)
class ItemSpec:
    """How the items of a user's dataset become a :class:`Batch`."""

    name: str = "dataset"  # how messages name the dataset (e.g. "data.name=pkg.mod:make train")
    input_key: str | None = None  # dict items: the input's key (None: the first of INPUT_KEYS present)
    label_key: str | None = None  # dict items: the label's key (None: the first of LABEL_KEYS present)
    collate: Callable[[list[Any]], Any] | None = None  # items -> (inputs, targets) or a dict; default_collate if None
    num_classes: int | None = None  # labels are checked against [0, num_classes) when known
    labelled: bool = True  # False (token windows): an item is its input, targets are zeros


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
            inputs, targets = self._pair(spec.collate(items), f"data.collate's result for samples {keys[:4].tolist()}")
        else:
            pairs = [self._pair(item, f"{spec.name}[{key}]") for key, item in zip(keys.tolist(), items)]
            inputs, targets = self._stack([p[0] for p in pairs], keys), default_collate([p[1] for p in pairs])
        if not isinstance(inputs, torch.Tensor):
            raise UserError(f"{spec.name}: samples {keys[:4].tolist()} collate to inputs of type "
                            f"{type(inputs).__name__}, not a tensor; {ITEM_HINT}")
        targets = torch.as_tensor(targets) if spec.labelled else torch.zeros(len(keys), dtype=torch.int64)
        return Batch(as_model_input(inputs), class_targets(targets, keys, spec), keys)

    def _pair(self, item: Any, where: str) -> tuple[Any, Any]:
        """(input, target) of one item, or of what data.collate returned."""
        if isinstance(item, Mapping):
            return item[_key(item, self.spec.input_key, INPUT_KEYS, "input", where)], (
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


def class_targets(targets: torch.Tensor, keys: torch.Tensor, spec: ItemSpec) -> torch.Tensor:
    """Labels as int64 class ids: one whole number per sample in ``[0, num_classes)``; the first bad
    one is refused naming its sample (a float label would be truncated, a negative one crash the loss)."""
    if targets.ndim != 1:
        raise UserError(f"{spec.name}: samples {keys[:4].tolist()} have labels of shape {tuple(targets.shape[1:])}; "
                        "classification needs one class id per sample; hint: data.label_key names the label")
    if targets.is_floating_point():
        bad = torch.nonzero(targets != targets.round()).flatten()
        if len(bad):
            i = int(bad[0])
            raise UserError(f"{spec.name}[{int(keys[i])}] has label {targets[i].item()!r}, not a whole number: "
                            "classification needs class ids 0..C-1; hint: regression targets are not supported")
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
