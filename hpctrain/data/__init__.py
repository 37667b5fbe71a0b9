"""Data: sources (real and synthetic), the training loaders and the evaluation loaders.

Where each concern lives:

* :mod:`~hpctrain.config.data`: the ``data`` section and the batch split (no torch);
* :mod:`~hpctrain.data.build`: :func:`build_data` / :func:`build_val_loader`, the loaders of a
  run from the ``data`` section plus runtime values, and the task the data asks for;
* :mod:`~hpctrain.data.sources`: every source by name (``data.name``, ``hpctrain data shard``);
  :mod:`~hpctrain.data.mnist`, :mod:`~hpctrain.data.synthetic`, :mod:`~hpctrain.data.files`,
  :mod:`~hpctrain.data.text` implement them;
* :mod:`~hpctrain.data.batch`: :class:`Batch`, :class:`ArrayDataset`, any map-style dataset;
* :mod:`~hpctrain.data.position`: every training loader's order, split, position and resume;
* :mod:`~hpctrain.data.in_memory`: loaders over a dataset in memory; :mod:`~hpctrain.data.user`:
  datasets as users have them (streams too); :mod:`~hpctrain.data.sampler`: samplers for a loop
  of your own;
* tar shards: :mod:`~hpctrain.data.manifest` (format, reading), :mod:`~hpctrain.data.writer`,
  :mod:`~hpctrain.data.indexing` (tars written elsewhere), :mod:`~hpctrain.data.verify`,
  :mod:`~hpctrain.data.shard_index` (a split's index), :mod:`~hpctrain.data.decode` (fields),
  :mod:`~hpctrain.data.shard_dataset` (reading), :mod:`~hpctrain.data.loader` (the map-style
  training loaders and the shard evaluation loader), :mod:`~hpctrain.data.foreign` (``data.path``
  indexed on first use), :mod:`~hpctrain.data.stage` (node-local copy).

The names below are exported lazily (PEP 562): importing ``hpctrain.config.data`` (the config
loader does) imports no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what mypy and editors see; at run time __getattr__ imports on first use
    from hpctrain.data.batch import ArrayDataset, Batch
    from hpctrain.data.build import (
        DataBundle,
        DataLayout,
        EvalBatches,
        TrainLoader,
        ValData,
        build_data,
        build_val_loader,
        eval_batch_size,
        load_val_set,
    )
    from hpctrain.data.errors import DataMissingError
    from hpctrain.data.in_memory import EvalLoader, MemoryLoader
    from hpctrain.data.loader import ShardedEvalLoader, ShardedLoader

_EXPORTS = {
    "ArrayDataset": "hpctrain.data.batch",
    "Batch": "hpctrain.data.batch",
    "DataBundle": "hpctrain.data.build",
    "DataLayout": "hpctrain.data.build",
    "EvalBatches": "hpctrain.data.build",
    "TrainLoader": "hpctrain.data.build",
    "ValData": "hpctrain.data.build",
    "build_data": "hpctrain.data.build",
    "build_val_loader": "hpctrain.data.build",
    "eval_batch_size": "hpctrain.data.build",
    "load_val_set": "hpctrain.data.build",
    "DataMissingError": "hpctrain.data.errors",
    "ShardedEvalLoader": "hpctrain.data.loader",
    "ShardedLoader": "hpctrain.data.loader",
    "EvalLoader": "hpctrain.data.in_memory",
    "MemoryLoader": "hpctrain.data.in_memory",
}

__all__ = [  # the keys of _EXPORTS, written out for linters (tests/data/test_sources.py compares them)
    "ArrayDataset", "Batch", "DataBundle", "DataLayout", "DataMissingError", "EvalBatches", "EvalLoader",
    "MemoryLoader", "ShardedEvalLoader", "ShardedLoader", "TrainLoader", "ValData", "build_data",
    "build_val_loader", "eval_batch_size", "load_val_set",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hpctrain.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
