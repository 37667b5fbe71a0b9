"""The DataLoader plumbing of the map-style loaders: a batch sampler whose batches are replaced
each epoch, the DataLoader over it, and hpctrain errors carried from a worker to the main process."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from torch.utils.data import DataLoader, Dataset, Sampler, get_worker_info

from hpctrain.core.errors import HpctrainError
from hpctrain.data.batch import Batch, PackedBatch, pass_batch

T = TypeVar("T")


def in_worker(read: Callable[[list[int]], T], ids: list[int]) -> T | WorkerError:
    """``read(ids)``; in a DataLoader worker, an hpctrain error is returned, not raised: DataLoader
    would re-raise it in the main process with the worker's traceback as its message."""
    if get_worker_info() is None:
        return read(ids)
    try:
        return read(ids)
    except HpctrainError as err:
        return WorkerError(err)


class WorkerError:
    """An hpctrain error raised in a DataLoader worker, carried to the main process as a batch
    (it pickles: its message is its only argument) and raised there by :func:`raise_worker_errors`."""

    def __init__(self, error: HpctrainError) -> None:
        self.error = error


def raise_worker_errors(batches: Iterator[Batch | PackedBatch | WorkerError]) -> Iterator[Batch]:
    """A DataLoader's batches, a worker's packed ones unpacked; a worker's error is raised here as
    itself: one line, no traceback."""
    for batch in batches:
        if isinstance(batch, WorkerError):
            raise batch.error
        yield batch.unpack() if isinstance(batch, PackedBatch) else batch



class BatchList(Sampler[list[int]]):
    """A batch sampler whose batches are replaced each epoch (the DataLoader, and its persistent
    workers, stay the same)."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def make_loader(dataset: Dataset, sampler: Sampler, num_workers: int, prefetch_factor: int, pin_memory: bool,
                 persistent_workers: bool) -> DataLoader:
    kwargs: dict[str, Any] = dict(batch_sampler=sampler, collate_fn=pass_batch, num_workers=num_workers,
                                  pin_memory=pin_memory)
    if num_workers > 0:
        kwargs.update(prefetch_factor=prefetch_factor, persistent_workers=persistent_workers)
    return DataLoader(dataset, **kwargs)
