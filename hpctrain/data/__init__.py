"""Data: sources (real and synthetic), the training loader and the evaluation loader.

:func:`build_data` is the one entry the trainer calls; each ``data.name`` maps to a pair
of loaders that follow the same small protocols:

* training loader: ``set_epoch(e)``, ``len()`` (batches per rank per epoch), iteration
  yielding :class:`Batch`, ``batches_done``, ``state_dict()`` / ``load_state_dict()``;
* evaluation loader: ``len()``, iteration over this rank's share (no sample twice across
  ranks), ``template()`` (a one-sample batch for masked padding steps).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hpctrain.config import Config
from hpctrain.data.memory import EvalLoader, MemoryLoader
from hpctrain.data.sources import ArrayDataset, Batch, DataMissingError, load_dataset
from hpctrain.env import ClusterEnv

__all__ = ["ArrayDataset", "Batch", "DataBundle", "DataMissingError", "EvalLoader", "MemoryLoader", "build_data"]


@dataclass
class DataBundle:
    train_loader: Any           # training-loader protocol (see module doc)
    val_loader: Any | None      # evaluation-loader protocol, or None
    num_classes: int
    input_shape: tuple[int, ...]
    train_size: int
    val_size: int


def build_data(cfg: Config, env: ClusterEnv, device: torch.device, *, with_val: bool = True) -> DataBundle:
    d = cfg.data
    train_set = load_dataset(d.name, "train", d.path, d.synthetic_size, cfg.seed).subset(d.max_train_samples)
    loader = MemoryLoader(train_set, env, d.batch_size, seed=cfg.seed, drop_last=d.drop_last,
                          num_workers=d.num_workers, prefetch_factor=d.prefetch_factor,
                          pin_memory=d.pin_memory and device.type == "cuda",
                          persistent_workers=d.persistent_workers)
    val_set = load_val_set(cfg) if with_val else None
    val_loader = EvalLoader(val_set, env, eval_batch_size(cfg)) if val_set is not None else None
    return DataBundle(loader, val_loader, train_set.num_classes, train_set.input_shape, len(train_set),
                      len(val_set) if val_set is not None else 0)


def load_val_set(cfg: Config) -> ArrayDataset:
    d = cfg.data
    return load_dataset(d.name, d.val_split, d.path, d.synthetic_size, cfg.seed).subset(d.max_val_samples)


def eval_batch_size(cfg: Config) -> int:
    return cfg.data.eval_batch_size or 2 * cfg.data.batch_size
