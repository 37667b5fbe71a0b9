"""The map-style training loaders and the shard evaluation loader: one global order, a rank x
worker split, exact and elastic resume (the order, split and position are
:mod:`~hpctrain.data.position`'s; reading shards is :mod:`~hpctrain.data.shard_dataset`'s).

Workers: the rank's batches go to its DataLoader workers round robin; each worker reads
whole batches with one ``pread`` per sample, in file order within the batch.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from hpctrain.core.env import ClusterEnv
from hpctrain.data.batch import Batch, BatchedDataset
from hpctrain.data.errors import ShardError, TruncatedShardError
from hpctrain.data.in_memory import rank_slice  # one split rule for every evaluation loader
from hpctrain.data.position import (
    PAD,
    EpochSplit,
    Position,
    Shuffle,
    check_same_order,
    epoch_order,
    limit_order,
    rank_plan,
)
from hpctrain.data.shard_dataset import OnCorrupt, ShardDataset, Transform
from hpctrain.data.shard_index import ShardIndex
from hpctrain.data.workers import BatchList, WorkerError, in_worker, make_loader, raise_worker_errors

log = logging.getLogger("hpctrain")


# ---------------------------------------------------------------- the training loader


class MapStyleLoader(Position):
    """Training batches for this rank of any map-style dataset whose ``__getitems__(ids)`` gives a
    :class:`Batch` (PAD ids: masked padding), in :func:`~hpctrain.data.position.epoch_order`
    split by :func:`~hpctrain.data.position.rank_plan`; follows hpctrain's training-loader protocol.

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
        self._split = EpochSplit(self.num_samples, batch_size, env.world_size, drop_last)
        if len(self) == 0:
            raise ShardError(f"{what} has {self.num_samples} samples: fewer than one global batch of "
                             f"{batch_size} x {env.world_size} ranks; hint: lower data.batch_size")
        self._sampler = BatchList()
        self._loader = make_loader(dataset, self._sampler, num_workers, prefetch_factor, pin_memory,
                                   persistent_workers)

    def order(self, epoch: int | None = None) -> np.ndarray:
        full = epoch_order(self.sizes, self.seed, self.epoch if epoch is None else epoch,
                           self.shuffle, self.shuffle_window)
        return limit_order(full, self.max_samples)

    def __iter__(self) -> Iterator[Batch]:
        token = self._begin_pass()
        self._mark_start()
        self._sampler.batches = rank_plan(self.order(), self._start, self.batch_size, self.env.world_size,
                                          self.env.rank, self.drop_last)
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

    def _order_key(self) -> dict[str, Any]:
        """What fixes the order a saved position points into."""
        return {"num_samples": self.num_samples, "seed": self.seed, "shuffle": self.shuffle,
                "shuffle_window": self.shuffle_window}

    def state_dict(self) -> dict[str, Any]:
        return {**self.position_state(), **self._order_key()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_same_order(state, self._order_key())
        self.set_epoch(int(state["epoch"]))
        self.seek(int(state["position"]))
        self._place()


class ShardedLoader(MapStyleLoader):
    """Training batches from tar shards for this rank (a :class:`MapStyleLoader` over the shards'
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
            msg = (f"shard {self.index.where(shard)} is truncated: sample {key!r} and those after it lie past the end "
                   f"of the file; hint: hpctrain data verify {self.index.place()}")
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
    """A map-style dataset read by a :class:`MapStyleLoader`: ``batched`` (an ArrayDataset or
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
        sampler = BatchList()
        sampler.batches = [list(self.ids[i : i + batch_size]) for i in range(0, len(self.ids), batch_size)]
        self._loader = make_loader(self.dataset, sampler, num_workers, prefetch_factor, pin_memory, False)

    def __len__(self) -> int:
        return -(-len(self.ids) // self.batch_size)

    def __iter__(self) -> Iterator[Batch]:
        return raise_worker_errors(iter(self._loader))

    def template(self) -> Batch:
        """A one-sample batch of the right shape, for masked padding steps."""
        return self.dataset.batch([0])
