"""What the loaders yield (:class:`Batch`) and what the in-memory loaders read: an
:class:`ArrayDataset`, or any map-style ``torch.utils.data.Dataset`` of ``(input, target)``
items (wrapped in :class:`ItemDataset`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset, default_collate

from hpctrain.errors import UserError

ITEM_HINT = "hint: dataset[i] must return (input, target), e.g. (a tensor, an int class)"


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


class ItemDataset(Dataset):
    """Any map-style dataset of ``(input, target)`` items, read a batch at a time as a :class:`Batch`:
    the items collated by torch's ``default_collate``, the indices as keys."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]  # batched() checked that it has one

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __getitems__(self, indices: list[int] | torch.Tensor) -> Batch:
        idx = _index(indices)
        ids = idx.tolist()
        # torch's own batched-fetch hook, when the dataset has one (Subset, StackDataset, ...)
        fetch = getattr(self.dataset, "__getitems__", None)
        items = fetch(ids) if fetch is not None else [self.dataset[i] for i in ids]
        return self._collate(list(items), idx)

    def _collate(self, items: list[Any], keys: torch.Tensor) -> Batch:
        name = type(self.dataset).__name__
        for key, item in zip(keys.tolist(), items):
            if not (isinstance(item, (tuple, list)) and len(item) == 2):
                raise UserError(f"{name}[{key}] is a {type(item).__name__}, not an (input, target) pair; {ITEM_HINT}")
        inputs, targets = default_collate(items)
        if not isinstance(inputs, torch.Tensor) or not isinstance(targets, torch.Tensor):
            raise UserError(f"{name}'s items collate to ({type(inputs).__name__}, {type(targets).__name__}), "
                            f"not tensors; {ITEM_HINT}")
        return Batch(inputs, targets, keys)


BatchedDataset = ArrayDataset | ItemDataset  # what the in-memory loaders read: __getitems__ gives a Batch


def batched(dataset: Dataset) -> BatchedDataset:
    """The dataset as the loaders read it: an ArrayDataset as it is (one tensor gather per batch),
    any other map-style dataset wrapped in :class:`ItemDataset`."""
    if isinstance(dataset, (ArrayDataset, ItemDataset)):
        return dataset
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
        raise UserError(f"{type(dataset).__name__} is not a map-style dataset (len(dataset) and dataset[i]); "
                        "hint: hpctrain's loaders split samples by index over ranks; wrap an iterable stream "
                        "in tar shards (`hpctrain data shard`) instead")
    return ItemDataset(dataset)


def pass_batch(batch: Batch) -> Batch:
    """collate_fn for datasets whose ``__getitems__`` already returns a Batch (picklable)."""
    return batch
