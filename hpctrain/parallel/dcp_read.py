"""Reading DCP checkpoints without running code from them.

torch's ``FileSystemReader.read_metadata`` unpickles ``.metadata`` with plain ``pickle``,
and the default load planner reads a checkpoint's non-tensor values (lr, step counts,
param groups) with ``torch.load(weights_only=False)``: whoever can write a checkpoint
directory (and rewrite its manifest's checksums) could run any command on the next
``resume``, ``ckpt export`` or ``eval``. Every DCP read in hpctrain goes through
:func:`load` and :func:`read_metadata` here instead: the metadata through
:mod:`hpctrain.core.safe_pickle` (DCP's own metadata classes, sizes, dtypes, paths: nothing
callable), the values through ``weights_only=True``. Both are pickles, so both pass
:mod:`hpctrain.core.safe_pickle`'s limits first: the metadata's nesting and size, and each value's
(and tensor's) ``torch.save`` zip before ``torch.load`` reads it. A refused file raises
:class:`~hpctrain.core.safe_pickle.UnsafePickleError` (exit 2), which a resume treats as a
corrupt checkpoint (skipped with the reason, or an error when it was named).
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem

from hpctrain.checkpoint import confine
from hpctrain.core import safe_pickle


class _ConfinedFileSystem(FileSystem):
    """DCP's file system, reading only regular files inside ``root``, opened non-blocking
    (:mod:`hpctrain.checkpoint.confine`): an item's file that is a FIFO, a device or a symlink
    out of the checkpoint is refused, never waited on or read."""

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = root

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        if mode != "rb":  # a reader never writes
            raise safe_pickle.UnsafePickleError(f"DCP reader asked to open {path} with mode {mode!r}")
        raw, _ = confine.open_regular(Path(path), self.root)
        with io.BufferedReader(raw) as stream:
            yield stream


class SafeReader(dcp.FileSystemReader):
    """A ``FileSystemReader`` whose metadata is unpickled with only DCP's own classes admitted,
    and whose items (each a ``torch.save`` zip in a ``.distcp`` file) are checked before
    ``torch.load`` reads them. Its files are read through :class:`_ConfinedFileSystem`."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path)
        self.fs = _ConfinedFileSystem(Path(path))

    def _slice_file(self, file: Any, sinfo: Any) -> Any:  # sinfo: DCP's _StorageInfo
        check_item(file, sinfo)
        return super()._slice_file(file, sinfo)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        try:
            data = confine.read_whole(Path(path), Path(self.path), confine.MAX_WHOLE, "DCP metadata")
        except confine.CheckpointError as err:  # refused (a FIFO, a symlink out, too large) or missing
            raise safe_pickle.UnsafePickleError(str(err)) from None
        metadata = safe_pickle.load(io.BytesIO(data), safe_pickle.dcp_metadata_allowed, f"DCP metadata {path}")
        if not isinstance(metadata, Metadata):
            raise safe_pickle.UnsafePickleError(f"DCP metadata {path} holds a {type(metadata).__name__}, not DCP's "
                                                f"Metadata; hint: the file was not written by torch's DCP")
        try:
            _check_storage(metadata, path)
            _check_sizes(metadata, Path(self.path), path)
            check_fields(metadata)
        except (AttributeError, TypeError, ValueError, KeyError) as err:  # DCP's classes, with fields missing
            raise safe_pickle.UnsafePickleError(f"DCP metadata {path} is malformed ({type(err).__name__}: {err}); "
                                                "hint: the checkpoint was not written by this program") from None
        storage_meta = metadata.storage_meta or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """The default planner, reading a checkpoint's non-tensor values with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except Exception as err:  # weights_only's refusal is a plain UnpicklingError / RuntimeError
            raise safe_pickle.UnsafePickleError(
                f"DCP value {read_item.dest_index.fqn} is not plain data (numbers, strings, tensors): refused "
                f"without running it ({type(err).__name__}); hint: the checkpoint was not written by this "
                f"program") from err
        # what DefaultLoadPlanner.load_bytes does after its own (unrestricted) torch.load
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def _check_storage(metadata: Metadata, path: Any) -> None:
    """Where the metadata says the items are: files of the checkpoint directory itself (no
    path out of it), stored as written here (no extension's transform: a compression bomb's way in)."""
    for info in (metadata.storage_data or {}).values():
        name = str(getattr(info, "relative_path", ""))
        if not name or "/" in name or "\\" in name or name in (".", ".."):
            raise safe_pickle.UnsafePickleError(f"DCP metadata {path} places an item in {name!r}, outside the "
                                                "checkpoint directory: refused; hint: the checkpoint was not written "
                                                "by this program")
        if getattr(info, "transform_descriptors", None):
            raise safe_pickle.UnsafePickleError(
                f"DCP metadata {path} stores an item of {name} through {list(info.transform_descriptors)}, which "
                "hpctrain never writes: refused; hint: the checkpoint was not written by this program")


def _check_sizes(metadata: Metadata, root: Path, path: Any) -> None:
    """The tensors the metadata declares: non-negative sizes of a torch dtype, and no more
    bytes in all than its files hold (DCP stores each byte once, uncompressed), so nothing
    reading the metadata (``ckpt export`` allocates each tensor) allocates what no file holds."""
    declared = 0
    for key, meta in (metadata.state_dict_metadata or {}).items():
        if not isinstance(meta, TensorStorageMetadata):
            continue
        dtype, size = getattr(meta.properties, "dtype", None), meta.size
        if not isinstance(dtype, torch.dtype) or not all(isinstance(n, int) and n >= 0 for n in size):
            raise safe_pickle.UnsafePickleError(f"DCP metadata {path}: tensor {key!r} declares size {list(size)} of "
                                                f"{dtype!r}: not a tensor; hint: the checkpoint was not written by "
                                                "this program")
        declared += math.prod(size) * dtype.itemsize
    held = 0
    for name in {str(info.relative_path) for info in (metadata.storage_data or {}).values()}:
        try:
            held += confine.check_regular(root / name, root)
        except confine.MissingFileError:
            pass  # holds nothing
        except confine.CheckpointError as err:  # a FIFO, a device, a symlink out
            raise safe_pickle.UnsafePickleError(str(err)) from None
    if declared > held:
        raise safe_pickle.UnsafePickleError(f"DCP metadata {path} declares {declared:,} bytes of tensors, more than "
                                            f"the {held:,} its files hold: refused before anything is allocated; "
                                            "hint: the checkpoint was not written by this program")


def check_fields(metadata: Metadata) -> None:
    """Every storage entry has the fields a reader uses, of their types (a crafted pickle can
    build DCP's classes with any attributes): raises AttributeError or TypeError otherwise."""
    for info in metadata.storage_data.values():
        if not (isinstance(info.relative_path, str) and isinstance(info.offset, int) and isinstance(info.length, int)):
            raise TypeError(f"storage entry {info!r} has fields of the wrong types")
    for meta in metadata.state_dict_metadata.values():
        if isinstance(meta, TensorStorageMetadata):
            for chunk in meta.chunks:
                if not all(isinstance(n, int) and n >= 0 for n in [*chunk.offsets, *chunk.sizes]):
                    raise ValueError(f"chunk {chunk!r} has offsets or sizes that are not non-negative ints")


def check_item(file: Any, sinfo: Any) -> None:
    """One item (a ``torch.save`` zip at ``sinfo.offset`` of an open ``.distcp`` file) against
    safe_pickle's limits, before ``torch.load`` reads it."""
    what = f"DCP item of {sinfo.relative_path} at byte {sinfo.offset}"
    offset, length, size = sinfo.offset, sinfo.length, os.fstat(file.fileno()).st_size
    if not all(isinstance(n, int) and n >= 0 for n in (offset, length)) or offset + length > size:
        raise safe_pickle.UnsafePickleError(f"{what}: {length!r} bytes at {offset!r} do not lie within the file's "
                                            f"{size:,} bytes; hint: the checkpoint was not written by this program")
    safe_pickle.check_torch_archive(_Window(file, sinfo.offset, sinfo.length), what)


def check_items(path: str | Path, metadata: Metadata, only: set[str] | None = None) -> None:
    """Every item of the DCP checkpoint directory ``path`` (of its files named in ``only``), as
    :class:`SafeReader` checks them while loading: a crafted one is found before anything is loaded."""
    by_file: dict[str, list[Any]] = {}
    for info in (metadata.storage_data or {}).values():
        if only is None or info.relative_path in only:
            by_file.setdefault(info.relative_path, []).append(info)
    for name, infos in sorted(by_file.items()):
        try:
            raw, _ = confine.open_regular(Path(path) / name, Path(path))
        except confine.CheckpointError as err:  # a FIFO, a device, a symlink out, missing
            raise safe_pickle.UnsafePickleError(str(err)) from None
        with io.BufferedReader(raw) as fh:
            for info in infos:
                check_item(fh, info)


class _Window(io.RawIOBase):
    """Bytes ``[offset, offset + length)`` of a seekable file, as a file of their own (what
    ``zipfile`` needs: DCP's own view mis-seeks from the end)."""

    def __init__(self, base: Any, offset: int, length: int) -> None:
        super().__init__()
        self._base, self._offset, self._length, self._pos = base, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        origin = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, origin + pos)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        n = max(0, min(len(buffer), self._length - self._pos))
        self._base.seek(self._offset + self._pos)
        got = self._base.readinto(memoryview(buffer).cast("B")[:n]) or 0
        self._pos += got
        return got


def read_metadata(path: str | Path) -> Metadata:
    """The metadata of the DCP checkpoint directory ``path``, read safely."""
    return SafeReader(str(path)).read_metadata()


def load(state: dict[str, Any], path: str | Path, process_group: Any = None, no_dist: bool = False) -> None:
    """``dcp.load`` of ``state`` from ``path`` with the safe reader and planner. A failure of
    DCP's read (an item that is not what the metadata says) is a :class:`CheckpointError` naming
    the first rank's reason, never DCP's own multi-rank traceback."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(state, storage_reader=SafeReader(str(path)), planner=SafePlanner(), process_group=process_group,
                 no_dist=no_dist)
    except CheckpointException as err:
        failures = [pair[0] if isinstance(pair, tuple) else pair for pair in err.failures.values()]  # (error, trace)
        first: BaseException = failures[0] if failures else err
        if isinstance(first, safe_pickle.UnsafePickleError):
            raise first from None
        reason = (str(first).strip().splitlines() or [type(first).__name__])[0]
        raise confine.CheckpointError(f"DCP checkpoint {path} cannot be read ({type(first).__name__}: {reason}) "
                                      "(corrupted or crafted); hint: `hpctrain ckpt verify` it") from None
