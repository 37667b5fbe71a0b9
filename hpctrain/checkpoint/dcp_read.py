"""Reading DCP checkpoints without running code from them.

torch's ``FileSystemReader.read_metadata`` unpickles ``.metadata`` with plain ``pickle``,
and the default load planner reads a checkpoint's non-tensor values (lr, step counts,
param groups) with ``torch.load(weights_only=False)``: whoever can write a checkpoint
directory (and rewrite its manifest's checksums) could run any command on the next
``resume``, ``ckpt export`` or ``eval``. Every DCP read in hpctrain goes through
:func:`load` and :func:`read_metadata` here instead: the metadata through
:mod:`hpctrain.safe_pickle` (DCP's own metadata classes, sizes, dtypes, paths: nothing
callable), the values through ``weights_only=True``. A refused file raises
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
    """A ``FileSystemReader`` whose metadata is unpickled with only DCP's own classes admitted."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = safe_pickle.load(stream, safe_pickle.dcp_metadata_allowed, f"DCP metadata {path}")
        if not isinstance(metadata, Metadata):
            raise safe_pickle.UnsafePickleError(f"DCP metadata {path} holds a {type(metadata).__name__}, not DCP's "
                                                f"Metadata; hint: the file was not written by torch's DCP")
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


def read_metadata(path: str | Path) -> Metadata:
    """The metadata of the DCP checkpoint directory ``path``, read safely."""
    return SafeReader(str(path)).read_metadata()


def load(state: dict[str, Any], path: str | Path, process_group: Any = None, no_dist: bool = False) -> None:
    """``dcp.load`` of ``state`` from ``path`` with the safe reader and planner."""
    dcp.load(state, storage_reader=SafeReader(str(path)), planner=SafePlanner(), process_group=process_group,
             no_dist=no_dist)
