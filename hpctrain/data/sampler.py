"""Samplers for a loop of your own: :class:`ResumableSampler`, a ``DistributedSampler`` that
resumes mid-epoch, and :class:`EvalSampler`, every sample once across the ranks.

``hpctrain.LoopCheckpoint`` records how many batches of the epoch were trained when it saved;
on resume it tells the sampler, and the next pass over that epoch starts right after them.
The order of an epoch is ``DistributedSampler``'s (seed + epoch), so the resumed run sees the
samples the uninterrupted one would have, in the same order, split by rank the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist
from torch.utils.data import Dataset, DistributedSampler, Sampler

from hpctrain.data.memory import rank_slice_of


class ResumableSampler(DistributedSampler[Any]):
    """``DistributedSampler(dataset, ...)`` (same arguments) that a checkpoint can resume mid-epoch."""

    def __init__(self, dataset: Dataset[Any], num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed,
                         drop_last=drop_last)
        self._resume: tuple[int, int] | None = None
        self._then: Callable[[], None] | None = None

    def resume_at(self, epoch: int, skip: int, then: Callable[[], None] | None = None) -> None:
        """The next pass over ``epoch`` leaves out this rank's first ``skip`` samples; ``then``
        runs as that pass begins (after the DataLoader made its iterator: see LoopCheckpoint)."""
        self._resume, self._then = (epoch, skip), then

    def __iter__(self) -> Iterator[Any]:
        indices = list(super().__iter__())
        if self._resume is not None:
            epoch, skip = self._resume
            then, self._resume, self._then = self._then, None, None
            if epoch == self.epoch:
                indices = indices[skip:]
            if then is not None:
                then()
        return iter(indices)


class EvalSampler(Sampler[int]):
    """This rank's contiguous slice of ``dataset``, in order: every sample once across the ranks.
    ``DistributedSampler`` pads the ranks to equal length (repeating samples), so sums over its
    shards count some samples twice, and one rank's shard is not the test set."""

    def __init__(self, dataset: Dataset[Any], num_replicas: int | None = None, rank: int | None = None) -> None:
        running = dist.is_available() and dist.is_initialized()
        world = num_replicas if num_replicas is not None else (dist.get_world_size() if running else 1)
        me = rank if rank is not None else (dist.get_rank() if running else 0)
        self.indices = rank_slice_of(len(dataset), me, world)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)
