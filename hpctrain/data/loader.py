"""Streaming tar shards into training: one global order, a rank x worker split, exact and
elastic resume.

The plan is a few pure functions, testable without processes:

* :func:`epoch_order` -- the global order of sample ids for (seed, epoch); it does not
  depend on the world size or the worker count.
* :func:`rank_batches` -- global step ``s`` takes positions ``[s*B*W, (s+1)*B*W)`` of
  that order; rank ``r`` takes the ``r``-th block of ``B`` of them. Progress is thus one
  number, the count of global positions consumed, and the rest of an epoch is the same
  set of samples whatever ``W`` resumes it.
* Remainder policy: ``drop_last=True`` (default) drops the last ``< B*W`` positions so
  every rank gets the same number of full batches; ``drop_last=False`` pads the last step
  with masked samples (mask 0, key ``""``) that training and evaluation ignore.

Workers: the rank's batches go to its DataLoader workers round robin; each worker reads
whole batches with one ``pread`` per sample, in file order within the batch.
"""

from __future__ import annotations

import io
import json
import logging
import os
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, get_worker_info

from hpctrain.core.env import ClusterEnv
from hpctrain.core.errors import HpctrainError, UserError
from hpctrain.data.batch import Batch, BatchedDataset, PackedBatch, as_model_input, pass_batch
from hpctrain.data.errors import CorruptSampleError, ShardError
from hpctrain.data.manifest import (
    IMAGE_EXTS,
    INPUT_EXTS,
    LABEL_EXTS,
    data_dir,
    load_index,
    load_manifest,
    manifest_path,
)
from hpctrain.data.memory import rank_slice  # one split rule for every evaluation loader
from hpctrain.data.pack import pillow
from hpctrain.data.passes import Passes

log = logging.getLogger("hpctrain")

Shuffle = Literal["global", "shard", "window", "none"]
OnCorrupt = Literal["stop", "skip"]
Transform = Callable[[dict[str, Any]], tuple[torch.Tensor, int]]
PAD = -1  # a padding slot in a batch plan


class TruncatedShardError(UserError, CorruptSampleError):
    """A shard found truncated before training starts: bad input (exit 2), not a failed run."""


MAX_OPEN_SHARDS = 64  # file descriptors one process keeps open (oldest closed first)


# ---------------------------------------------------------------- the plan (pure functions)


def epoch_order(shard_sizes: Sequence[int], seed: int, epoch: int, shuffle: Shuffle = "shard",
                window: int = 1000) -> np.ndarray:
    """Global sample ids (shard-major numbering) in this epoch's order.

    global: one permutation of everything (random reads); shard: shards shuffled, samples
    shuffled inside each shard (reads stay in one or two files at a time); window: like
    shard, but a shard is cut into windows of ``window`` consecutive samples whose order
    and contents are shuffled (reads stay within a window: near-sequential IO); none: file order.
    """
    sizes = np.asarray(shard_sizes, dtype=np.int64)
    firsts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    if shuffle == "none":
        return np.arange(int(sizes.sum()), dtype=np.int64)
    rng = np.random.Generator(np.random.PCG64([seed, epoch]))
    if shuffle == "global":
        return rng.permutation(int(sizes.sum())).astype(np.int64)
    parts = []
    for s in rng.permutation(len(sizes)):
        local = np.arange(sizes[s], dtype=np.int64)
        if shuffle == "shard":
            local = rng.permutation(local)
        elif shuffle == "window":
            wins = [rng.permutation(local[i : i + window]) for i in range(0, len(local), window)]
            local = np.concatenate([wins[i] for i in rng.permutation(len(wins))]) if wins else local
        else:
            raise ValueError(f"shuffle={shuffle!r} is not one of global, shard, window, none")
        parts.append(firsts[s] + local)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def limit_order(order: np.ndarray, limit: int | None) -> np.ndarray:
    """Keep only ids below ``limit`` (data.max_train_samples), in the same order."""
    return order if limit is None else order[order < limit]


def remaining_batches(total: int, position: int, batch_size: int, world: int, drop_last: bool) -> int:
    """Batches per rank from global position ``position`` to the end of the epoch."""
    left = max(0, total - position)
    step = batch_size * world
    return left // step if drop_last else -(-left // step)


def rank_batches(total: int, position: int, batch_size: int, world: int, rank: int,
                 drop_last: bool) -> list[list[int]]:
    """Positions (into the epoch order) of each of this rank's batches; PAD marks padding."""
    step = batch_size * world
    out = []
    for s in range(remaining_batches(total, position, batch_size, world, drop_last)):
        first = position + s * step + rank * batch_size
        out.append([p if p < total else PAD for p in range(first, first + batch_size)])
    return out


def rank_plan(order: np.ndarray, position: int, batch_size: int, env: ClusterEnv, drop_last: bool) -> list[list[int]]:
    """This rank's batches as global sample ids (PAD for padding)."""
    batches = rank_batches(len(order), position, batch_size, env.world_size, env.rank, drop_last)
    return [[int(order[p]) if p != PAD else PAD for p in b] for b in batches]


# ---------------------------------------------------------------- reading and decoding


class ShardIndex:
    """Manifest + per-shard indexes of one split, as flat arrays over global sample ids."""

    def __init__(self, root: str | Path, split: str) -> None:
        self.root, self.split = Path(root), split
        self.manifest = load_manifest(root, split)
        self.data_root = data_dir(root, self.manifest)  # the tars; root holds manifest and indexes
        self.shards = self.manifest["shards"]
        self.fields: list[str] = list(self.manifest["fields"])
        self.decode: dict[str, Any] = self.manifest.get("decode") or {}
        self.classes: list[str] = list(self.manifest.get("classes") or [])
        self._check_present()
        # load_index checks every range (non-negative, inside the declared bytes) and gives int64 arrays
        indexes = [load_index(root, s, self.fields) for s in self.shards]
        self.sizes = [len(ix["keys"]) for ix in indexes]
        self.keys: list[str] = [k for ix in indexes for k in ix["keys"]]
        self.shard_of = np.repeat(np.arange(len(indexes), dtype=np.int32), self.sizes)
        self.start = np.concatenate([ix["start"] for ix in indexes])
        self.length = np.concatenate([ix["end"] for ix in indexes]) - self.start
        self.crc = np.concatenate([ix["crc32"] for ix in indexes])
        self.offsets = np.concatenate([ix["offsets"] for ix in indexes])
        # what each shard held when opened: a read never asks for more than is there (see ShardDataset.read)
        self.file_bytes = [(self.data_root / s["name"]).stat().st_size for s in self.shards]

    def __len__(self) -> int:
        return len(self.keys)

    def _check_present(self) -> None:
        """A shard the manifest lists but the directory lacks is missing input (not a truncated one)."""
        if not self.shards:
            raise ShardError(f"{manifest_path(self.root, self.split)} lists no shards; hint: write the split again "
                             "(`hpctrain data shard` or `hpctrain data index`)")
        odd = [s["name"] for s in self.shards if (self.data_root / s["name"]).exists()
               and not (self.data_root / s["name"]).is_file()]
        if odd:  # a FIFO would block the first read, a device stream forever
            raise ShardError(f"shard {self.data_root / odd[0]} is not a regular file (a FIFO, device or directory); "
                             f"hint: put the tar file itself there, then `hpctrain data verify {self.root}`")
        missing = [s["name"] for s in self.shards if not (self.data_root / s["name"]).is_file()]
        if missing:
            shown = ", ".join(missing[:3]) + (" ..." if len(missing) > 3 else "")
            manifest = manifest_path(self.root, self.split)
            raise ShardError(f"{len(missing)} of the {len(self.shards)} shards that {manifest} lists are missing from "
                             f"{self.data_root}: {shown}; hint: copy them back (or stage the data again), then check "
                             f"with `hpctrain data verify {self.root}`")

    def truncated(self) -> list[tuple[str, str]]:
        """(shard, first sample key past the end) for each shard shorter than its index says."""
        out, first = [], 0
        for shard, count, size in zip(self.shards, self.sizes, self.file_bytes):
            ends = self.start[first : first + count] + self.length[first : first + count]
            beyond = np.nonzero(ends > size)[0]
            if len(beyond):
                out.append((shard["name"], self.keys[first + int(beyond[0])]))
            first += count
        return out


_NPY_HEADERS: dict[bytes, tuple[np.dtype, tuple[int, ...], bool]] = {}


def decode_npy(data: bytes) -> np.ndarray:
    """np.load costs ~47 us per small array here; the header is parsed once per distinct header."""
    if data[:6] != b"\x93NUMPY":
        raise ValueError("not an .npy payload")
    hlen = int.from_bytes(data[8:10], "little") if data[6] == 1 else int.from_bytes(data[8:12], "little")
    body = 10 + hlen if data[6] == 1 else 12 + hlen
    head = data[:body]
    parsed = _NPY_HEADERS.get(head)
    if parsed is None:
        fh = io.BytesIO(head)
        version = np.lib.format.read_magic(fh)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = read(fh)  # numpy's own header parser
        parsed = _NPY_HEADERS.setdefault(head, (dtype, shape, fortran))
    dtype, shape, fortran = parsed
    arr = np.frombuffer(data, dtype=dtype, offset=body)
    return arr.reshape(shape[::-1]).T if fortran else arr.reshape(shape)


_PIL_FORMATS = ("PNG", "JPEG")


_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _spng() -> Any:
    """``pyspng`` (libspng) when installed: ~3x faster than PIL on small PNGs, same pixels."""
    global _SPNG
    if _SPNG is None:
        try:
            import pyspng  # type: ignore[import-untyped,import-not-found]  # optional, no stubs

            _SPNG = pyspng.load
        except ImportError:
            _SPNG = False
    return _SPNG


_SPNG: Any = None


def decode_image(data: bytes) -> np.ndarray:
    """uint8 HxW (grayscale) or HxWx3 pixels; anything but 8-bit gray/RGB is converted to RGB by PIL."""
    # IHDR: bit depth at byte 24, colour type at 25 (0 = gray, 2 = RGB); those decode as they are
    if data[:8] == _PNG_SIGNATURE and data[24:26] in (b"\x08\x00", b"\x08\x02") and (spng := _spng()):
        return spng(data)
    from PIL import Image

    # No ``with``: the image holds only this in-memory buffer, and closing it costs ~4 us a sample.
    img: Image.Image = Image.open(io.BytesIO(data), formats=_PIL_FORMATS)  # no probing of every plugin
    if img.mode not in ("L", "RGB"):
        img = img.convert("RGB")
    # the pixels PIL decoded, as np.asarray(img) gives them, without its array-interface detour
    shape = (img.height, img.width) if img.mode == "L" else (img.height, img.width, 3)
    return np.frombuffer(img.tobytes(), dtype=np.uint8).reshape(shape)


@dataclass(frozen=True)
class InputConversion:
    """How a batch of stacked raw inputs becomes the model's input, from the manifest's decode
    info: HWC images to NCHW, then ``/ scale`` and ``(x - mean) / std`` when given. Arrays of
    integers other than uint8 (token ids, integer features) stay integers, as int64. A value,
    not a method, so that a worker's :class:`PackedBatch` carries it to the main process."""

    image: bool
    scale: float | None = None
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None

    @classmethod
    def of(cls, info: dict[str, Any], input_field: str) -> InputConversion:
        mean, std = info.get("mean"), info.get("std")
        return cls(image=input_field.rsplit(".", 1)[-1] in IMAGE_EXTS or info.get("layout") == "hwc",
                   scale=float(info["scale"]) if info.get("scale") else None,
                   mean=None if mean is None else tuple(mean), std=None if std is None else tuple(std))

    def __call__(self, arr: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(arr)
        if self.image:  # NCHW in uint8 first: a quarter of the bytes to move as float (same values)
            t = (t.unsqueeze(1) if t.ndim == 3 else t.permute(0, 3, 1, 2)).contiguous()
        if not (self.image or self.scale or self.mean is not None):
            return as_model_input(t).contiguous()
        x = t.float()
        if self.scale:
            x = x.div_(self.scale)
        if self.mean is not None and self.std is not None:
            shape = (1, -1) + (1,) * (x.ndim - 2)
            x = (x - torch.tensor(self.mean).view(shape)) / torch.tensor(self.std).view(shape)
        return x.contiguous()


def decode_field(ext: str, data: bytes) -> Any:
    """png/jpg -> uint8 HxW[xC] array; npy -> array; cls -> int; json -> object; txt -> str; else bytes."""
    last = ext.rsplit(".", 1)[-1].lower()
    if last in IMAGE_EXTS:
        return decode_image(data)
    if last == "npy":
        return decode_npy(data)
    if last in LABEL_EXTS:
        return int(data.decode().strip())
    if last == "json":
        return json.loads(data)
    if last in ("txt", "text"):
        return data.decode()
    return data


class ShardDataset(Dataset):
    """Map-style dataset over global sample ids; ``__getitems__`` returns a whole :class:`Batch`.

    Files are opened lazily in each process (workers get their own descriptors); reads are
    ``os.pread`` (no shared file offset, no tar parsing) in file order within a batch.
    """

    def __init__(self, index: ShardIndex, *, transform: Transform | None = None,
                 on_corrupt: OnCorrupt = "stop", readahead: bool = True) -> None:
        if on_corrupt not in ("stop", "skip"):
            raise ValueError(f"data.on_corrupt={on_corrupt!r} must be stop or skip")
        self.index, self.transform, self.on_corrupt, self.readahead = index, transform, on_corrupt, readahead
        self.input_field = index.decode.get("input") or _first_input(index.fields)
        self.target_field = index.decode.get("target") or ("cls" if "cls" in index.fields else None)
        self.target_key = index.decode.get("target_key")  # the label inside a .json record
        if self.input_field not in index.fields:
            raise ShardError(f"{index.root}: input field {self.input_field!r} is not among the fields {index.fields}")
        if transform is None and self.target_field is not None and self.target_field not in index.fields:
            raise ShardError(f"{index.root}: label field {self.target_field!r} (the manifest's decode.target) is not "
                             f"among the fields {index.fields}; hint: write the split again")
        if transform is None and self.input_field.rsplit(".", 1)[-1] not in INPUT_EXTS:
            raise ShardError(f"{index.root}: samples hold .{self.input_field} (not an image or array); "
                             "hint: pass transform=fn(sample_dict) -> (tensor, label) to the loader")
        ext = self.input_field.rsplit(".", 1)[-1]
        if ext in IMAGE_EXTS and not (ext == "png" and _spng()):  # libspng alone reads most PNGs
            pillow()  # here, as a UserError with the install hint, not as every sample's decode failure
        self._conversion = InputConversion.of(index.decode, self.input_field)
        self._fds: dict[int, int] = {}
        self._pid = os.getpid()
        self._fill: Any = None

    def __len__(self) -> int:
        return len(self.index)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fds": {}}

    def _fd(self, shard: int) -> int:
        if self._pid != os.getpid():  # a forked worker: never share descriptors with the parent
            self._fds, self._pid = {}, os.getpid()
        fd = self._fds.get(shard)
        if fd is None:
            if len(self._fds) >= MAX_OPEN_SHARDS:  # thousands of shards: keep descriptors bounded
                os.close(self._fds.pop(next(iter(self._fds))))
            # O_NONBLOCK: a shard swapped for a FIFO since the start must not hang the open (pread then fails)
            fd = self._fds[shard] = os.open(self.index.data_root / self.index.shards[shard]["name"],
                                            os.O_RDONLY | os.O_NONBLOCK)
            if self.readahead and hasattr(os, "posix_fadvise"):
                # The epoch reads this whole shard soon, in an order the kernel cannot guess:
                # ask for all of it now, read sequentially in the background.
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        return fd

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}

    def read(self, gid: int) -> dict[str, Any]:
        """The decoded fields of one sample (plus ``__key__``), or CorruptSampleError."""
        ix = self.index
        shard, start, length = int(ix.shard_of[gid]), int(ix.start[gid]), int(ix.length[gid])
        # never ask for bytes past the end the shard had when opened: a truncated shard under
        # data.on_corrupt=skip reads short (and is skipped) instead of allocating the index's length
        fd = self._fd(shard)
        try:
            data = os.pread(fd, min(length, max(0, ix.file_bytes[shard] - start)), start)
        except OSError as err:  # EIO of a bad sector; ESPIPE of a shard replaced by a FIFO
            raise CorruptSampleError(f"{self._where(gid)}: cannot be read: {err.strerror}; hint: hpctrain data "
                                     f"verify {ix.root}") from err
        if len(data) != length or zlib.crc32(data) != int(ix.crc[gid]):
            self._raise_corrupt(gid, data)
        sample: dict[str, Any] = {"__key__": ix.keys[gid]}
        offs = ix.offsets[gid]
        try:
            for j, ext in enumerate(ix.fields):
                sample[ext] = decode_field(ext, data[offs[2 * j] : offs[2 * j] + offs[2 * j + 1]])
        except Exception as err:  # any decoder failure is a bad sample, named
            raise CorruptSampleError(f"{self._where(gid)}: cannot decode: {err}") from err
        return sample

    def _where(self, gid: int) -> str:
        ix = self.index
        return f"shard {ix.data_root / ix.shards[int(ix.shard_of[gid])]['name']} sample {ix.keys[gid]!r}"

    def _raise_corrupt(self, gid: int, data: bytes) -> None:
        ix, where, length, start = self.index, self._where(gid), int(self.index.length[gid]), int(self.index.start[gid])
        if len(data) != length:
            raise CorruptSampleError(f"{where}: only {len(data)} of {length} bytes at offset {start} (truncated "
                                     f"shard); hint: hpctrain data verify {ix.root}, re-shard or re-stage; "
                                     "data.on_corrupt=skip skips")
        raise CorruptSampleError(f"{where}: CRC-32 mismatch (corrupt bytes); hint: hpctrain data verify {ix.root}; "
                                 "data.on_corrupt=skip skips bad samples")

    def _read_or_skip(self, gid: int) -> dict[str, Any] | None:
        try:
            sample = self.read(gid)
            if self.transform is None:
                self._label(gid, sample)  # a record without its label is this sample's fault: the policy applies
            return sample
        except CorruptSampleError as err:
            if self.on_corrupt == "stop":
                raise
            log.warning("skipping a bad sample: %s", err)
            return None

    def __getitems__(self, ids: list[int]) -> Batch | PackedBatch | WorkerError:
        if get_worker_info() is None:
            return self.batch(ids)
        return in_worker(self.packed, ids)  # made a Batch in the main process (raise_worker_errors)

    def batch(self, ids: list[int]) -> Batch:
        """The samples ``ids`` (PAD: a masked padding slot) as one :class:`Batch`."""
        return self.packed(ids).unpack()

    def packed(self, ids: list[int]) -> PackedBatch:
        """The samples ``ids`` read, decoded and stacked, before the conversion to tensors."""
        real = sorted({g for g in ids if g != PAD}, key=lambda g: (self.index.shard_of[g], self.index.start[g]))
        samples = {g: self._read_or_skip(g) for g in real}  # file order within the batch
        rows = [self._convert(samples.get(g)) for g in ids]
        inputs, targets, keys, mask = [], [], [], []
        for g, row in zip(ids, rows):
            inputs.append(row[0] if row is not None else None)
            targets.append(row[1] if row is not None else 0)
            keys.append(self.index.keys[g] if g != PAD else "")  # masked + key = skipped; masked, no key = padding
            mask.append(row is not None)
        return PackedBatch(self._stack(inputs), targets, keys, None if all(mask) else mask,
                           None if self.transform is not None else self._conversion)

    def _convert(self, sample: dict[str, Any] | None) -> tuple[Any, int] | None:
        if sample is None:
            return None
        if self.transform is not None:
            x, y = self.transform(sample)
            return x, int(y)
        return sample[self.input_field], self._label(-1, sample)

    def _label(self, gid: int, sample: dict[str, Any]) -> int:
        """The sample's class: its label field, or the ``target_key`` of its .json record."""
        try:
            target: Any = sample[self.target_field] if self.target_field else 0
            if self.target_key is not None:
                target = target[self.target_key]
            return int(target)
        except (KeyError, IndexError, TypeError, ValueError) as err:
            where = self._where(gid) if gid >= 0 else f"sample {sample.get('__key__')!r}"
            raise CorruptSampleError(f"{where}: no class label ({type(err).__name__}: {err}); hint: hpctrain data "
                                     f"verify {self.index.root}; data.on_corrupt=skip skips bad samples") from err

    def _stack(self, inputs: list[Any]) -> Any:
        """The batch's inputs stacked, as numpy (for a worker's pipe, see PackedBatch): the raw arrays,
        or the transform's tensors (a tensor still where numpy lacks the dtype)."""
        fill = next((x for x in inputs if x is not None), None)
        if fill is None:  # every slot is padding or skipped: zeros of a real sample's shape
            fill = self._fallback_input()
        if self.transform is not None:
            zero = torch.zeros_like(torch.as_tensor(fill))
            stacked = torch.stack([torch.as_tensor(x) if x is not None else zero for x in inputs])
            try:
                return stacked.numpy()  # shares the memory: no copy
            except (TypeError, RuntimeError):  # bfloat16, float8 (no numpy dtype), or a tensor needing grad
                return stacked
        zero = np.zeros_like(fill)
        return np.stack([x if x is not None else zero for x in inputs])

    def _fallback_input(self) -> Any:
        if self._fill is None:
            for gid in range(len(self.index)):
                row = self._convert(self._read_or_skip(gid))
                if row is not None:
                    self._fill = row[0]
                    break
            else:
                raise CorruptSampleError(f"{self.index.root}: no sample of split {self.index.split} can be read")
        return self._fill

    def sample_shape(self) -> tuple[int, ...]:
        """The shape of one decoded input (from the first sample)."""
        return tuple(self.batch([0]).inputs.shape[1:])


T = TypeVar("T")


def in_worker(read: Callable[[list[int]], T], ids: list[int]) -> T | WorkerError:
    """``read(ids)``; in a DataLoader worker, an hpctrain error is returned, not raised: DataLoader
    would re-raise it in the main process with the worker's traceback as its message."""
    if get_worker_info() is None:
        return read(ids)
    try:
        return read(ids)
    except HpctrainError as err:
        return WorkerError(err)


class WorkerError:
    """An hpctrain error raised in a DataLoader worker, carried to the main process as a batch
    (it pickles: its message is its only argument) and raised there by :func:`raise_worker_errors`."""

    def __init__(self, error: HpctrainError) -> None:
        self.error = error


def raise_worker_errors(batches: Iterator[Batch | PackedBatch | WorkerError]) -> Iterator[Batch]:
    """A DataLoader's batches, a worker's packed ones unpacked; a worker's error is raised here as
    itself: one line, no traceback."""
    for batch in batches:
        if isinstance(batch, WorkerError):
            raise batch.error
        yield batch.unpack() if isinstance(batch, PackedBatch) else batch


def _first_input(fields: list[str]) -> str:
    for f in fields:
        if f.rsplit(".", 1)[-1] in INPUT_EXTS:
            return f
    return next((f for f in fields if f != "cls"), fields[0])


class _PlanSampler(Sampler[list[int]]):
    """A batch sampler whose plan is replaced each epoch (the DataLoader, and its persistent
    workers, stay the same)."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def _make_loader(dataset: Dataset, sampler: Sampler, num_workers: int, prefetch_factor: int, pin_memory: bool,
                 persistent_workers: bool) -> DataLoader:
    kwargs: dict[str, Any] = dict(batch_sampler=sampler, collate_fn=pass_batch, num_workers=num_workers,
                                  pin_memory=pin_memory)
    if num_workers > 0:
        kwargs.update(prefetch_factor=prefetch_factor, persistent_workers=persistent_workers)
    return DataLoader(dataset, **kwargs)


# ---------------------------------------------------------------- the training loader


class PlanLoader(Passes):
    """Training batches for this rank of any map-style dataset whose ``__getitems__(ids)`` gives a
    :class:`Batch` (PAD ids: masked padding), by the plan above; follows hpctrain's
    training-loader protocol.

    ``state_dict()`` holds the epoch and the count of global positions consumed, so a
    resume at the same world size reproduces the uninterrupted batches exactly, and a
    resume at another world size or worker count reads the epoch's rest exactly once.
    ``sizes``: the sample counts of the dataset's consecutive parts (shards; one part for a
    dataset in memory), which ``shuffle`` keeps together or not.
    """

    def __init__(self, dataset: Dataset, sizes: Sequence[int], env: ClusterEnv, batch_size: int, *, seed: int = 0,
                 shuffle: Shuffle = "shard", shuffle_window: int = 1000, drop_last: bool = True,
                 num_workers: int = 0, prefetch_factor: int = 2, pin_memory: bool = False,
                 persistent_workers: bool = True, max_samples: int | None = None, what: str = "the data") -> None:
        if batch_size <= 0:
            raise ValueError(f"data.batch_size={batch_size} must be > 0")
        if shuffle_window <= 0:
            raise ValueError(f"data.shuffle_window={shuffle_window} must be > 0")
        self.dataset, self.sizes = dataset, list(sizes)
        self.env, self.batch_size, self.seed, self.drop_last = env, batch_size, seed, drop_last
        self.shuffle, self.shuffle_window, self.max_samples = shuffle, shuffle_window, max_samples
        total = sum(self.sizes)
        self.num_samples = min(total, max_samples or total)
        if len(self) == 0:
            raise ShardError(f"{what} has {self.num_samples} samples: fewer than one global batch of "
                             f"{batch_size} x {env.world_size} ranks; hint: lower data.batch_size")
        self._sampler = _PlanSampler()
        self._loader = _make_loader(dataset, self._sampler, num_workers, prefetch_factor, pin_memory,
                                    persistent_workers)
        self.epoch, self.batches_done = 0, 0
        self._start_position, self._start_done = 0, 0

    # protocol -------------------------------------------------------------
    def __len__(self) -> int:
        return remaining_batches(self.num_samples, 0, self.batch_size, self.env.world_size, self.drop_last)

    def _rewind(self) -> None:
        self.batches_done, self._start_position, self._start_done = 0, 0, 0

    @property
    def position(self) -> int:
        """Global samples of this epoch's order consumed by all ranks together."""
        step = self.batch_size * self.env.world_size
        return min(self.num_samples, self._start_position + (self.batches_done - self._start_done) * step)

    def order(self, epoch: int | None = None) -> np.ndarray:
        full = epoch_order(self.sizes, self.seed, self.epoch if epoch is None else epoch,
                           self.shuffle, self.shuffle_window)
        return limit_order(full, self.max_samples)

    def __iter__(self) -> Iterator[Batch]:
        token = self._begin_pass()
        self._start_position, self._start_done = self.position, self.batches_done
        self._sampler.batches = rank_plan(self.order(), self._start_position, self.batch_size, self.env, self.drop_last)
        return self._pass_batches(token)

    def _pass_batches(self, token: int) -> Iterator[Batch]:
        for batch in raise_worker_errors(iter(self._loader)):
            if not self._current(token):
                return
            self.batches_done += 1
            self._seen(batch)
            yield batch
        self._epoch_done()
        self._end_pass(token)

    def _seen(self, batch: Batch) -> None:
        """Each batch as it is yielded (a subclass counts what it needs)."""

    def _epoch_done(self) -> None:
        """The epoch's last batch was yielded."""

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "num_samples": self.num_samples,
                "seed": self.seed, "shuffle": self.shuffle, "shuffle_window": self.shuffle_window,
                "batches_done": self.batches_done, "world_size": self.env.world_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("num_samples", "seed", "shuffle", "shuffle_window"):
            mine = getattr(self, key)
            if key in state and state[key] != mine:
                raise ValueError(f"loader state has {key}={state[key]!r} but this loader has {mine!r}: the saved "
                                 "position would point into another order; hint: resume with the same data and seed")
        self.set_epoch(int(state["epoch"]))
        position = int(state["position"])
        left = remaining_batches(self.num_samples, position, self.batch_size, self.env.world_size, self.drop_last)
        # batches_done is what the trainer counts from; at another world size the saved
        # position need not fall on a batch boundary of ours, so count back from the end.
        self.batches_done = self._start_done = len(self) - left
        self._start_position = position
        self._place()


class ShardedLoader(PlanLoader):
    """Training batches from tar shards for this rank (a :class:`PlanLoader` over the shards'
    samples); bad samples are stopped at or skipped and counted (``data.on_corrupt``)."""

    def __init__(self, root: str | Path, env: ClusterEnv, batch_size: int, *, split: str = "train", seed: int = 0,
                 shuffle: Shuffle = "shard", shuffle_window: int = 1000, drop_last: bool = True,
                 num_workers: int = 0, prefetch_factor: int = 2, pin_memory: bool = False,
                 persistent_workers: bool = True, transform: Transform | None = None,
                 on_corrupt: OnCorrupt = "stop", max_samples: int | None = None) -> None:
        self.index = ShardIndex(root, split)
        # global shuffle touches every shard at once: whole-shard readahead would only thrash
        dataset = ShardDataset(self.index, transform=transform, on_corrupt=on_corrupt, readahead=shuffle != "global")
        self._check_truncation(on_corrupt)
        super().__init__(dataset, self.index.sizes, env, batch_size, seed=seed, shuffle=shuffle,
                         shuffle_window=shuffle_window, drop_last=drop_last, num_workers=num_workers,
                         prefetch_factor=prefetch_factor, pin_memory=pin_memory,
                         persistent_workers=persistent_workers, max_samples=max_samples, what=f"{root} ({split})")
        self.dataset: ShardDataset = dataset
        self.skipped, self.skipped_keys = 0, []  # type: tuple[int, list[str]]

    def _check_truncation(self, on_corrupt: OnCorrupt) -> None:
        for shard, key in self.index.truncated():
            msg = (f"shard {self.index.root / shard} is truncated: sample {key!r} and those after it lie past the end "
                   f"of the file; hint: hpctrain data verify {self.index.root}")
            if on_corrupt == "stop":
                raise TruncatedShardError(msg + "; data.on_corrupt=skip skips them")
            log.warning("%s (data.on_corrupt=skip: they will be skipped and counted)", msg)

    def _epoch_done(self) -> None:
        if self.skipped:
            log.warning("epoch %d: %d bad samples skipped so far on rank %d (data.on_corrupt=skip), first: %s",
                        self.epoch, self.skipped, self.env.rank, ", ".join(self.skipped_keys[:5]))

    def _seen(self, batch: Batch) -> None:
        if batch.mask is None:
            return
        bad = [k for k, m in zip(batch.keys, batch.mask.tolist()) if not m and k]
        if bad:
            self.skipped += len(bad)
            self.skipped_keys += bad[: max(0, 100 - len(self.skipped_keys))]

    def stats(self) -> dict[str, Any]:
        """Counters for metrics and the run summary (skipped bad samples on this rank)."""
        return {"skipped_samples": self.skipped, "skipped_keys": list(self.skipped_keys)}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "skipped_samples": self.skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.skipped = int(state.get("skipped_samples", 0))


class IndexedBatches(Dataset):
    """A map-style dataset read by a :class:`PlanLoader`: ``batched`` (an ArrayDataset or
    ItemDataset) gives the samples; a PAD slot repeats a real sample, masked, key -1."""

    def __init__(self, batched: BatchedDataset) -> None:
        self.batched = batched

    def __len__(self) -> int:
        return len(self.batched)

    def __getitems__(self, ids: list[int]) -> Batch | WorkerError:
        return in_worker(self.batch, ids)

    def batch(self, ids: list[int]) -> Batch:
        fill = next((i for i in ids if i != PAD), 0)
        batch = self.batched.__getitems__([i if i != PAD else fill for i in ids])
        if PAD not in ids:
            return batch
        real = torch.tensor([i != PAD for i in ids])
        return Batch(batch.inputs, batch.targets, torch.tensor(ids, dtype=torch.int64), real)

    def template(self) -> Batch:
        return self.batch([0])


# ---------------------------------------------------------------- the evaluation loader


class ShardedEvalLoader:
    """This rank's contiguous share of a split's samples, in file order; no sample twice across
    ranks, none left out (evaluate() pads short ranks with masked batches from ``template()``)."""

    def __init__(self, root: str | Path, env: ClusterEnv, batch_size: int, *, split: str = "val",
                 transform: Transform | None = None, on_corrupt: OnCorrupt = "stop",
                 max_samples: int | None = None, num_workers: int = 0, prefetch_factor: int = 2,
                 pin_memory: bool = False) -> None:
        self.index = ShardIndex(root, split)
        self.dataset = ShardDataset(self.index, transform=transform, on_corrupt=on_corrupt)
        self.num_samples = min(len(self.index), max_samples or len(self.index))
        self.ids = rank_slice(self.num_samples, env)
        self.batch_size = batch_size
        sampler = _PlanSampler()
        sampler.batches = [list(self.ids[i : i + batch_size]) for i in range(0, len(self.ids), batch_size)]
        self._loader = _make_loader(self.dataset, sampler, num_workers, prefetch_factor, pin_memory, False)

    def __len__(self) -> int:
        return -(-len(self.ids) // self.batch_size)

    def __iter__(self) -> Iterator[Batch]:
        return raise_worker_errors(iter(self._loader))

    def template(self) -> Batch:
        """A one-sample batch of the right shape, for masked padding steps."""
        return self.dataset.batch([0])
