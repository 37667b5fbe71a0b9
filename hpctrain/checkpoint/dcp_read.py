"""Reading DCP checkpoints without running code from them.

torch's ``FileSystemReader.read_metadata`` unpickles ``.metadata`` with plain ``pickle``,
and the default load planner reads a checkpoint's non-tensor values (lr, step counts,
param groups) with ``torch.load(weights_only=False)``: whoever can write a checkpoint
directory (and rewrite its manifest's checksums) could run any command on the next
``resume``, ``ckpt export`` or ``eval``. Every DCP read in hpctrain goes through
:func:`load` and :func:`read_metadata` here instead: the metadata through
:mod:`hpctrain.safe_pickle` (DCP's own metadata classes, sizes, dtypes, paths: nothing
callable), the values through ``weights_only=True``. Both are pickles, so both pass
:mod:`hpctrain.safe_pickle`'s limits first: the metadata's nesting and size, and each value's
(and tensor's) ``torch.save`` zip before ``torch.load`` reads it. A refused file raises
:class:`~hpctrain.safe_pickle.UnsafePickleError` (exit 2), which a resume treats as a
corrupt checkpoint (skipped with the reason, or an error when it was named).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from hpctrain import safe_pickle


class SafeReader(dcp.FileSystemReader):
    """A ``FileSystemReader`` whose metadata is unpickled with only DCP's own classes admitted,
    and whose items (each a ``torch.save`` zip in a ``.distcp`` file) are checked before
    ``torch.load`` reads them."""

    def _slice_file(self, file: Any, sinfo: Any) -> Any:  # sinfo: DCP's _StorageInfo
        check_item(file, sinfo)
        return super()._slice_file(file, sinfo)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = safe_pickle.load(stream, safe_pickle.dcp_metadata_allowed, f"DCP metadata {path}")
        if not isinstance(metadata, Metadata):
            raise safe_pickle.UnsafePickleError(f"DCP metadata {path} holds a {type(metadata).__name__}, not DCP's "
                                                f"Metadata; hint: the file was not written by torch's DCP")
        _check_storage(metadata, path)
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


def check_item(file: Any, sinfo: Any) -> None:
    """One item (a ``torch.save`` zip at ``sinfo.offset`` of an open ``.distcp`` file) against
    safe_pickle's limits, before ``torch.load`` reads it."""
    what = f"DCP item of {sinfo.relative_path} at byte {sinfo.offset}"
    safe_pickle.check_torch_archive(_Window(file, sinfo.offset, sinfo.length), what)


def check_items(path: str | Path, metadata: Metadata, only: set[str] | None = None) -> None:
    """Every item of the DCP checkpoint directory ``path`` (of its files named in ``only``), as
    :class:`SafeReader` checks them while loading: a crafted one is found before anything is loaded."""
    by_file: dict[str, list[Any]] = {}
    for info in (metadata.storage_data or {}).values():
        if only is None or info.relative_path in only:
            by_file.setdefault(info.relative_path, []).append(info)
    for name, infos in sorted(by_file.items()):
        with open(Path(path) / name, "rb") as fh:
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
    """``dcp.load`` of ``state`` from ``path`` with the safe reader and planner."""
    dcp.load(state, storage_reader=SafeReader(str(path)), planner=SafePlanner(), process_group=process_group,
             no_dist=no_dist)
