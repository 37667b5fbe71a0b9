"""Synthetic data for benchmarks and tests: no download, any size, learnable (each class has
its own mean pattern plus noise)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hpctrain.config.data import SPLITS, check_split
from hpctrain.data.batch import ArrayDataset
from hpctrain.data.errors import ShardError
from hpctrain.data.pack import DEFAULT_PACK, PackOptions, PackSource, labelled_samples, npy_bytes

if TYPE_CHECKING:
    from hpctrain.config.data import DataConfig

CIFAR_SHAPE = (3, 32, 32)
TINY_SHAPE = (128,)


def synthetic(split: str, size: int, shape: tuple[int, ...], num_classes: int = 10, seed: int = 0) -> ArrayDataset:
    """Learnable random data: each class has its own mean pattern plus noise."""
    check_split(split)
    gen = torch.Generator().manual_seed(seed * 1000 + SPLITS.index(split))
    centers = torch.randn((num_classes, *shape), generator=torch.Generator().manual_seed(seed))
    y = torch.randint(0, num_classes, (size,), generator=gen)
    x = centers[y] * 0.5 + torch.randn((size, *shape), generator=gen)
    return ArrayDataset(x, y, num_classes, f"synthetic{list(shape)}/{split}")


def _size(data: DataConfig, split: str) -> int:
    """data.synthetic_size samples for training, a fifth of that for each held-out split."""
    return data.synthetic_size if split == "train" else max(1, data.synthetic_size // 5)


def cifar_split(data: DataConfig, split: str, seed: int) -> ArrayDataset:
    """Source hook (``data.name=synthetic_cifar``): CIFAR-shaped images."""
    return synthetic(split, _size(data, split), CIFAR_SHAPE, seed=seed)


def tiny_split(data: DataConfig, split: str, seed: int) -> ArrayDataset:
    """Source hook (``data.name=synthetic_tiny``): 128 features per sample."""
    return synthetic(split, _size(data, split), TINY_SHAPE, seed=seed)


def synthetic_cifar_source(count: str, split: str, options: PackOptions = DEFAULT_PACK) -> PackSource:
    """Source hook (``hpctrain data shard synthetic_cifar:N``): N CIFAR-shaped samples as ``.npy``."""
    if not count.isdigit() or int(count) <= 0:
        raise ShardError(f"synthetic_cifar:{count}: N must be a positive number of samples, e.g. synthetic_cifar:50000")
    data = synthetic(split, int(count), CIFAR_SHAPE)
    meta = {"source": f"synthetic_cifar:{int(count)}", "classes": [str(i) for i in range(10)],
            "decode": {"input": "npy", "target": "cls"}}
    return labelled_samples(data.inputs.numpy(), data.targets.numpy(), split, meta, "npy", npy_bytes)
