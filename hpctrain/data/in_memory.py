"""Loaders for in-memory datasets: an :class:`~hpctrain.data.batch.ArrayDataset` (one tensor
gather per batch) or any map-style ``torch.utils.data.Dataset`` of ``(input, target)`` items
(collated by torch's ``default_collate``; the sample indices are the batch's keys).

Training: DistributedSampler order, per-rank batches, and a position (epoch, batches done:
:mod:`~hpctrain.data.position`) that can be saved and restored mid-epoch. Evaluation: contiguous
per-rank slices, so every sample is evaluated exactly once across ranks (no padding repeats)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Generic, TypeVar

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from hpctrain.core.env import ClusterEnv
from hpctrain.data.batch import TARGET_KINDS, Batch, BatchedDataset, ItemSpec, batched, pass_batch
from hpctrain.data.position import EpochSplit, Position, skip_ahead

D = TypeVar("D", bound=Dataset)  # the dataset as given: loader.dataset keeps its type


class _SkipSampler(Sampler[int]):
    """The wrapped sampler's indices from position ``start`` on (mid-epoch resume)."""

    def __init__(self, inner: DistributedSampler, start: int) -> None:
        self.inner, self.start = inner, start

    def __iter__(self) -> Iterator[int]:
        return iter(skip_ahead(list(self.inner), self.start))

    def __len__(self) -> int:
        return max(0, len(self.inner) - self.start)


class MemoryLoader(Position, Generic[D]):
    """Per-rank batches of a map-style dataset, in DistributedSampler order.

    The global order depends only on (seed, epoch), so a run with batch b on N ranks sees
    exactly the samples of a run with batch N*b on one rank. ``targets`` says what a dataset's
    labels must be (the task's ``Task.targets``): ``class`` ids (checked), ``float`` values
    (regression), ``multilabel`` 0/1 vectors, ``tokens`` (no labels) or ``any`` (unchecked).
    Each ``iter()`` is a pass over an epoch (:mod:`~hpctrain.data.position`); ``set_epoch`` picks
    the epoch (the training loop does).
    """

    def __init__(self, dataset: D, env: ClusterEnv, batch_size: int, *, seed: int = 0,
                 shuffle: bool = True, drop_last: bool = True, num_workers: int = 0,
                 prefetch_factor: int = 2, pin_memory: bool = False, persistent_workers: bool = True,
                 targets: str = "class") -> None:
        self.dataset, self.batch_size, self.drop_last = dataset, batch_size, drop_last
        self._batches = _batched(dataset, targets)  # a batch at a time: one gather for an ArrayDataset
        self.num_workers = num_workers
        self.sampler: DistributedSampler[Any] = DistributedSampler(self._batches, num_replicas=env.world_size,
                                                                   rank=env.rank, shuffle=shuffle, seed=seed,
                                                                   drop_last=False)
        self._loader_kwargs: dict[str, Any] = dict(
            batch_size=batch_size, drop_last=drop_last, collate_fn=pass_batch, num_workers=num_workers,
            pin_memory=pin_memory,
        )
        if num_workers > 0:
            self._loader_kwargs.update(prefetch_factor=prefetch_factor, persistent_workers=persistent_workers)
        # DistributedSampler pads the order to a multiple of the world size: those are the epoch's positions
        self._split = EpochSplit(len(self.sampler) * env.world_size, batch_size, env.world_size, drop_last)
        self._loader: DataLoader | None = None

    def _rewind(self) -> None:
        super()._rewind()
        self.sampler.set_epoch(self.epoch)

    def _rank_start(self) -> int:
        """This rank's first index in its share of the order: rank r holds positions r, r+W, ..."""
        return self.position // self._split.world

    def __iter__(self) -> Iterator[Batch]:
        token = self._begin_pass()
        self.sampler.set_epoch(self.epoch)  # also after Lightning set the sampler's epoch its own way
        return self._pass_batches(token)

    def _pass_batches(self, token: int) -> Iterator[Batch]:
        batches = self._in_process() if self.num_workers == 0 else self._through_workers()
        for batch in batches:
            if not self._current(token):
                return
            self.batches_done += 1
            yield batch
        self._end_pass(token)

    def _in_process(self) -> Iterator[Batch]:
        # Without workers a DataLoader adds only per-batch Python overhead to what is one
        # tensor gather: slice the epoch's index order directly (same order, same batches).
        order = torch.as_tensor(list(self.sampler), dtype=torch.long)
        total = len(order)
        for start in range(self._rank_start(), total, self.batch_size):
            if self.drop_last and start + self.batch_size > total:
                return  # a short last batch (plain arithmetic: Tensor.__len__ is a Python call)
            yield self._batches.__getitems__(order[start : start + self.batch_size])

    def _through_workers(self) -> Iterator[Batch]:
        start = self._rank_start()
        if start == 0:
            return iter(self._full_epoch_loader())
        # A resumed epoch: a one-off loader over the remaining indices.
        return iter(DataLoader(self._batches, sampler=_SkipSampler(self.sampler, start),
                               **{**self._loader_kwargs, "persistent_workers": False}))

    def _full_epoch_loader(self) -> DataLoader:
        # One DataLoader for the whole run, so persistent workers survive epochs.
        if self._loader is None:
            self._loader = DataLoader(self._batches, sampler=self.sampler, **self._loader_kwargs)
        return self._loader

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batches_done": self.batches_done}  # the keys checkpoints have always had

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.set_epoch(int(state["epoch"]))
        self._seek_batches(int(state["batches_done"]))
        self._place()


def _batched(dataset: Dataset, targets: str) -> BatchedDataset:
    """The dataset read a batch at a time, its targets checked as ``targets`` says."""
    if targets not in TARGET_KINDS:
        raise ValueError(f"targets={targets!r} is not one of {TARGET_KINDS}")
    return batched(dataset, ItemSpec(type(dataset).__name__, targets=targets, labelled=targets != "tokens"))


def rank_slice(n: int, env: ClusterEnv) -> range:
    """This rank's contiguous share of n samples; shares differ by at most one."""
    return rank_slice_of(n, env.rank, env.world_size)


def rank_slice_of(n: int, rank: int, world: int) -> range:
    return range(rank * n // world, (rank + 1) * n // world)


class EvalLoader(Generic[D]):
    """This rank's slice of a map-style dataset, in order, in batches; no sample twice.
    ``targets`` as for :class:`MemoryLoader`."""

    def __init__(self, dataset: D, env: ClusterEnv, batch_size: int, *, targets: str = "class") -> None:
        self.dataset, self.batch_size = dataset, batch_size
        self._batches = _batched(dataset, targets)
        self.indices = rank_slice(len(self._batches), env)

    def __len__(self) -> int:
        return -(-len(self.indices) // self.batch_size)

    def __iter__(self) -> Iterator[Batch]:
        for start in range(0, len(self.indices), self.batch_size):
            chunk = self.indices[start : start + self.batch_size]
            yield self._batches.__getitems__(list(chunk))

    def template(self) -> Batch:
        """A one-sample batch of the right shape, for masked padding steps."""
        return self._batches.__getitems__([0])
