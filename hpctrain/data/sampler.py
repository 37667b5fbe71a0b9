"""Samplers for a loop of your own: :class:`ResumableSampler`, a ``DistributedSampler`` that
resumes mid-epoch, and :class:`EvalSampler`, every sample once across the ranks.

``hpctrain.LoopCheckpoint`` records how many batches of the epoch were trained when it saved;
on resume it tells the sampler, and every pass over that epoch starts right after them until
training goes on (the first optimizer step), so a stray ``next(iter(loader))`` (the PyTorch DDP
tutorial's ``b_sz``) neither uses up nor repeats the position.
The order of an epoch is ``DistributedSampler``'s (seed + epoch), so the resumed run sees the
samples the uninterrupted one would have, in the same order, split by rank the same way.

Both samplers may be built before the process group (Lightning and many scripts build their
loaders first): the number of ranks and this rank then come from the launcher's environment
(torchrun's or Slurm's variables, :func:`hpctrain.core.env.detect`), as the group will have them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import Dataset, DistributedSampler, Sampler

from hpctrain.core.env import detect
from hpctrain.data.in_memory import rank_slice_of
from hpctrain.data.position import skip_ahead


def world_and_rank(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    """The given values, else the running process group's, else the launcher's environment
    (a sampler built before ``init_process_group``), else one process."""
    env = detect()  # a running group first, then torchrun's / Slurm's variables
    world = num_replicas if num_replicas is not None else env.world_size
    me = rank if rank is not None else env.rank
    if not 0 <= me < world:
        raise ValueError(f"rank {me} is not in [0, {world}) (num_replicas={world}); hint: pass both, or neither")
    return world, me


class ResumableSampler(DistributedSampler[Any]):
    """``DistributedSampler(dataset, ...)`` (same arguments) that a checkpoint can resume mid-epoch."""

    def __init__(self, dataset: Dataset[Any], num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> None:
        num_replicas, rank = world_and_rank(num_replicas, rank)
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed,
                         drop_last=drop_last)
        self._resume: tuple[int, int] | None = None
        self._then: Callable[[], None] | None = None
        self._until_done = False

    def resume_at(self, epoch: int, skip: int, then: Callable[[], None] | None = None, *,
                  until_done: bool = False) -> None:
        """The next pass over ``epoch`` leaves out this rank's first ``skip`` samples; ``then``
        runs as that pass begins (after the DataLoader made its iterator: see LoopCheckpoint).
        ``until_done``: every pass (over ``epoch`` or an earlier one, as a loop's stray
        ``next(iter(loader))`` makes) keeps the position and runs ``then``, until
        :meth:`resume_done` or a pass over a later epoch: the last pass made before training
        goes on is the one it prepared."""
        self._resume, self._then, self._until_done = (epoch, skip), then, until_done

    def resume_done(self) -> None:
        """Training went on from the resumed position: later passes are whole epochs again."""
        self._resume, self._then = None, None

    def __iter__(self) -> Iterator[Any]:
        indices = list(super().__iter__())
        if self._resume is None:
            return iter(indices)
        epoch, skip = self._resume
        then = self._then
        if not self._until_done or self.epoch > epoch:  # one pass only, or the resumed epoch is over
            self.resume_done()
        if epoch == self.epoch:
            indices = skip_ahead(indices, skip)
        if then is not None:
            then()
        return iter(indices)


class EvalSampler(Sampler[int]):
    """This rank's contiguous slice of ``dataset``, in order: every sample once across the ranks.
    ``DistributedSampler`` pads the ranks to equal length (repeating samples), so sums over its
    shards count some samples twice, and one rank's shard is not the test set."""

    def __init__(self, dataset: Dataset[Any], num_replicas: int | None = None, rank: int | None = None) -> None:
        world, me = world_and_rank(num_replicas, rank)
        self.indices = rank_slice_of(len(dataset), me, world)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)
