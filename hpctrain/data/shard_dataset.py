"""Reading tar shards: :class:`ShardDataset`, a map-style dataset over a split's global sample ids
whose ``__getitems__`` reads, checks (length, CRC-32) and decodes a whole batch, with
``data.on_corrupt`` deciding what a bad sample does."""

from __future__ import annotations

import logging
import os
import zlib
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

from hpctrain.data.batch import Batch, PackedBatch
from hpctrain.data.decode import InputConversion, _spng, decode_field
from hpctrain.data.errors import CorruptSampleError, ShardError
from hpctrain.data.manifest import IMAGE_EXTS, INPUT_EXTS
from hpctrain.data.pack import pillow
from hpctrain.data.position import PAD
from hpctrain.data.remote import ShardReader, open_reader
from hpctrain.data.shard_index import ShardIndex
from hpctrain.data.workers import WorkerError, in_worker

log = logging.getLogger("hpctrain")

OnCorrupt = Literal["stop", "skip"]
Transform = Callable[[dict[str, Any]], tuple[torch.Tensor, int]]
MAX_OPEN_SHARDS = 64  # file descriptors one process keeps open (oldest closed first)


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
        self._reader: ShardReader | None = None  # shards on object storage: this process's ranged reads

    def __len__(self) -> int:
        return len(self.index)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fds": {}, "_reader": None}

    def _remote(self) -> ShardReader:
        if self._reader is None or self._pid != os.getpid():  # a forked worker: its own connections and threads
            self._fds, self._pid = {}, os.getpid()
            self._reader = open_reader(self.index.manifest, self.readahead, self.index.file_bytes)
        return self._reader

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
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    def read(self, gid: int) -> dict[str, Any]:
        """The decoded fields of one sample (plus ``__key__``), or CorruptSampleError."""
        ix = self.index
        shard, start, length = int(ix.shard_of[gid]), int(ix.start[gid]), int(ix.length[gid])
        # never ask for bytes past the end the shard had when opened: a truncated shard under
        # data.on_corrupt=skip reads short (and is skipped) instead of allocating the index's length
        size = self._span(gid)[2]
        if ix.remote:  # the store's errors (RunError: not answering; UserError: refused) are not the sample's
            data = self._remote().read(shard, start, size)
        else:
            try:
                data = os.pread(self._fd(shard), size, start)
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

    def _span(self, gid: int) -> tuple[int, int, int]:
        """(shard, start, bytes to read) of a sample: never past the end the shard had when opened,
        so a truncated shard under data.on_corrupt=skip reads short (and is skipped)."""
        ix = self.index
        shard, start = int(ix.shard_of[gid]), int(ix.start[gid])
        return shard, start, min(int(ix.length[gid]), max(0, ix.file_bytes[shard] - start))

    def _where(self, gid: int) -> str:
        ix = self.index
        return f"shard {ix.where(int(ix.shard_of[gid]))} sample {ix.keys[gid]!r}"

    def _raise_corrupt(self, gid: int, data: bytes) -> None:
        ix, where, length, start = self.index, self._where(gid), int(self.index.length[gid]), int(self.index.start[gid])
        if len(data) != length:
            raise CorruptSampleError(f"{where}: only {len(data)} of {length} bytes at offset {start} (truncated "
                                     f"shard); hint: hpctrain data verify {ix.place()}, re-shard or re-stage; "
                                     "data.on_corrupt=skip skips")
        raise CorruptSampleError(f"{where}: CRC-32 mismatch (corrupt bytes); hint: hpctrain data verify {ix.place()}; "
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
        if self.index.remote:  # the batch's ranges fetched in parallel, then decoded one by one
            self._remote().prefetch(self._span(g) for g in real)
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


def _first_input(fields: list[str]) -> str:
    for f in fields:
        if f.rsplit(".", 1)[-1] in INPUT_EXTS:
            return f
    return next((f for f in fields if f != "cls"), fields[0])
