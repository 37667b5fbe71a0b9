"""Data: sources (real and synthetic), the training loader and the evaluation loader.

:func:`build_data` is the one entry the trainer calls; each ``data.name`` maps to a pair
of loaders that follow the same small protocols:

* training loader: ``set_epoch(e)``, ``len()`` (batches per rank per epoch), iteration
  yielding :class:`Batch`, ``batches_done``, ``state_dict()`` / ``load_state_dict()``;
* evaluation loader: ``len()``, iteration over this rank's share (no sample twice across
  ranks), ``template()`` (a one-sample batch for masked padding steps).

``data.name=shards`` streams tar shards written by ``hpctrain data shard`` (see
:mod:`hpctrain.data.shards`, :mod:`hpctrain.data.loader`, :mod:`hpctrain.data.stage`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from hpctrain.data.loader import ShardedEvalLoader, ShardedLoader
from hpctrain.data.memory import EvalLoader, MemoryLoader
from hpctrain.data.sources import ArrayDataset, Batch, DataMissingError, load_dataset
from hpctrain.data.text import shakespeare_root, text_layout, tokens_of
from hpctrain.env import ClusterEnv
from hpctrain.section import ConfigError

if TYPE_CHECKING:  # the composed config imports this package: no runtime import back
    from hpctrain.config import Config

log = logging.getLogger("hpctrain")
SHARD_NAMES = ("shards", "shakespeare")  # data.name values read through the shard loader

__all__ = ["ArrayDataset", "Batch", "DataBundle", "DataMissingError", "EvalBatches", "EvalLoader", "MemoryLoader",
           "ShardedEvalLoader", "ShardedLoader", "TrainLoader", "build_data", "build_val_loader"]


class TrainLoader(Protocol):
    """What the trainer and the checkpointer need of a training loader (MemoryLoader, ShardedLoader)."""

    batches_done: int  # batches of the current epoch already yielded (restored by load_state_dict)

    def set_epoch(self, epoch: int) -> None: ...
    def __len__(self) -> int: ...  # batches per rank per epoch
    def __iter__(self) -> Iterator[Batch]: ...  # the rest of the epoch, from batches_done on
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class EvalBatches(Protocol):
    """What evaluate() needs of an evaluation loader (EvalLoader, ShardedEvalLoader)."""

    def __len__(self) -> int: ...  # this rank's batches
    def __iter__(self) -> Iterator[Batch]: ...  # this rank's share; no sample on two ranks
    def template(self) -> Batch: ...  # a one-sample batch, for masked padding steps


@dataclass
class DataBundle:
    train_loader: TrainLoader
    val_loader: EvalBatches | None
    num_classes: int
    input_shape: tuple[int, ...]
    train_size: int
    val_size: int
    input_dtype: torch.dtype = torch.float32  # the model's input: torch.long for token ids
    task: str = "classification"  # what the data asks of the loop (hpctrain.tasks): causal_lm for text


def build_data(cfg: Config, env: ClusterEnv, device: torch.device, *, with_val: bool = True) -> DataBundle:
    d = cfg.data
    if d.name in SHARD_NAMES:
        return _build_shard_data(cfg, env, device, with_val)
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


# ---------------------------------------------------------------- tar shards (data.name=shards)


def _shard_root(cfg: Config, env: ClusterEnv) -> Path:
    """The manifests of data.path (tars written elsewhere are indexed on first use), or their
    node-local copy when staging is on (data.stage_dir / $SLURM_TMPDIR)."""
    from hpctrain.data.foreign import prepare
    from hpctrain.data.stage import resolve_stage_dir, stage_shards

    splits = ["train", cfg.data.val_split]
    stage_dir = resolve_stage_dir(cfg.data.stage_dir)
    if cfg.data.name == "shakespeare":  # sharded on first use into the cache, at the model's context length
        return stage_shards(shakespeare_root(cfg.model.seq_len, env), stage_dir, env, splits)
    if not cfg.data.path:
        raise ConfigError("data.name=shards needs data.path=DIR (made by `hpctrain data shard SOURCE DIR`, "
                          "or a directory of WebDataset tars)")
    root = prepare(cfg.data.path, splits, env)
    return stage_shards(root, stage_dir, env, splits)


def _build_shard_data(cfg: Config, env: ClusterEnv, device: torch.device, with_val: bool) -> DataBundle:
    d = cfg.data
    root = _shard_root(cfg, env)
    text = text_layout(root)
    loader = ShardedLoader(root, env, d.batch_size, split="train", seed=cfg.seed, shuffle=d.shuffle,
                           shuffle_window=d.shuffle_window, drop_last=d.drop_last, num_workers=d.num_workers,
                           prefetch_factor=d.prefetch_factor, pin_memory=d.pin_memory and device.type == "cuda",
                           persistent_workers=d.persistent_workers, on_corrupt=d.on_corrupt,
                           max_samples=d.max_train_samples, transform=tokens_of if text else None)
    val = _shard_val_loader(cfg, env, root) if with_val else None
    if text is not None:  # token windows of seq_len + 1: the model sees (seq_len,) int64 ids
        return DataBundle(loader, val, text.vocab, (text.seq_len,), loader.num_samples,
                          val.num_samples if val else 0, torch.long, "causal_lm")
    return DataBundle(loader, val, _num_classes(cfg, loader.index.classes, root), loader.dataset.sample_shape(),
                      loader.num_samples, val.num_samples if val else 0)


def _num_classes(cfg: Config, classes: list[str], root: Path) -> int:
    if classes:
        return len(classes)
    if cfg.model.num_classes:
        return cfg.model.num_classes
    raise ConfigError(f"the manifest in {root} lists no classes; hint: set model.num_classes")


def _shard_val_loader(cfg: Config, env: ClusterEnv, root: Path) -> ShardedEvalLoader | None:
    from hpctrain.data.shards import manifest_path

    if not manifest_path(root, cfg.data.val_split).is_file():
        log.warning("no %s split in %s: training without validation (hint: hpctrain data shard SOURCE %s --split %s)",
                    cfg.data.val_split, root, cfg.data.path, cfg.data.val_split)
        return None
    return ShardedEvalLoader(root, env, eval_batch_size(cfg), split=cfg.data.val_split, on_corrupt=cfg.data.on_corrupt,
                             max_samples=cfg.data.max_val_samples,
                             transform=tokens_of if text_layout(root, cfg.data.val_split) else None)


def build_val_loader(cfg: Config, env: ClusterEnv) -> tuple[EvalBatches, int, tuple[int, ...]]:
    """(evaluation loader, num_classes, input shape) for any data.name; for ``hpctrain eval``."""
    if cfg.data.name in SHARD_NAMES:
        loader = _shard_val_loader(cfg, env, _shard_root(cfg, env))
        if loader is None:
            raise ConfigError(f"data.path={cfg.data.path} has no {cfg.data.val_split} split to evaluate")
        root = loader.index.root
        text = text_layout(root, cfg.data.val_split)
        if text is not None:
            return loader, text.vocab, (text.seq_len,)
        return loader, _num_classes(cfg, loader.index.classes, root), loader.dataset.sample_shape()
    dataset = load_val_set(cfg)
    return EvalLoader(dataset, env, eval_batch_size(cfg)), dataset.num_classes, dataset.input_shape
