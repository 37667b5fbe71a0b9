"""Where a training loader is in its epoch: the one resumable-position core under every loader.

* **Order.** An epoch is an order of the dataset's samples fixed by (seed, epoch) alone, not by
  the world size or the worker count: :func:`epoch_order` for map-style data and shards;
  ``DistributedSampler``'s for :class:`~hpctrain.data.in_memory.MemoryLoader` and
  :class:`~hpctrain.data.sampler.ResumableSampler`; the stream's own for a
  :class:`~hpctrain.data.user.StreamLoader`.
* **Position.** Global step ``s`` takes positions ``[s*B*W, (s+1)*B*W)`` of that order, so
  progress is one number: the positions all ranks together consumed (:attr:`Position.position`).
  Rank ``r`` takes the ``r``-th block of ``B`` of them (:func:`rank_batches`), or, for a
  ``DistributedSampler`` order, every ``W``-th of them from ``r`` on (the same set per step).
* **Skip-ahead and state.** A restored position is where the next pass starts
  (:meth:`Position.seek`); at another world size the rest of the epoch is the same samples,
  each read once. ``state_dict`` keys stay what each loader saved before this core existed.
* **Passes.** Every training loader restarts on each ``iter()``, as a ``DataLoader`` does. A
  position set on purpose (a new loader, ``set_epoch``, ``load_state_dict``, the end of an
  epoch) is where the next ``iter()`` starts; the training loop calls ``set_epoch`` before each
  epoch. Once a pass has started, the next ``iter()`` is a new epoch from its first batch,
  whether or not the previous pass ran to its end: Lightning stops after ``len(loader)``
  batches without exhausting the iterator, a plain ``for`` loop may ``break``.

Remainder: ``drop_last=True`` drops the last ``< B*W`` positions, so every rank gets the same
number of full batches; ``drop_last=False`` keeps a last, short step (padded where a loader pads).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import numpy as np

Shuffle = Literal["global", "shard", "window", "none"]
PAD = -1  # a padding slot in a rank's batch (masked: training and evaluation ignore it)
T = TypeVar("T")


# ---------------------------------------------------------------- the order


def epoch_order(shard_sizes: Sequence[int], seed: int, epoch: int, shuffle: Shuffle = "shard",
                window: int = 1000) -> np.ndarray:
    """Global sample ids (shard-major numbering) in this epoch's order.

    global: one permutation of everything (random reads); shard: shards shuffled, samples
    shuffled inside each shard (reads stay in one or two files at a time); window: like
    shard, but a shard is cut into windows of ``window`` consecutive samples whose order
    and contents are shuffled (reads stay within a window: near-sequential IO); none: file order.
    """
    sizes = np.asarray(shard_sizes, dtype=np.int64)
    firsts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    if shuffle == "none":
        return np.arange(int(sizes.sum()), dtype=np.int64)
    rng = np.random.Generator(np.random.PCG64([seed, epoch]))
    if shuffle == "global":
        return rng.permutation(int(sizes.sum())).astype(np.int64)
    parts = []
    for s in rng.permutation(len(sizes)):
        local = np.arange(sizes[s], dtype=np.int64)
        if shuffle == "shard":
            local = rng.permutation(local)
        elif shuffle == "window":
            wins = [rng.permutation(local[i : i + window]) for i in range(0, len(local), window)]
            local = np.concatenate([wins[i] for i in rng.permutation(len(wins))]) if wins else local
        else:
            raise ValueError(f"shuffle={shuffle!r} is not one of global, shard, window, none")
        parts.append(firsts[s] + local)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def limit_order(order: np.ndarray, limit: int | None) -> np.ndarray:
    """Keep only ids below ``limit`` (data.max_train_samples), in the same order."""
    return order if limit is None else order[order < limit]


# ---------------------------------------------------------------- the split of the order into steps


def remaining_batches(total: int, position: int, batch_size: int, world: int, drop_last: bool) -> int:
    """Batches per rank from global position ``position`` to the end of the epoch."""
    left = max(0, total - position)
    step = batch_size * world
    return left // step if drop_last else -(-left // step)


def rank_batches(total: int, position: int, batch_size: int, world: int, rank: int,
                 drop_last: bool) -> list[list[int]]:
    """Positions (into the epoch order) of each of this rank's batches; PAD marks padding."""
    step = batch_size * world
    out = []
    for s in range(remaining_batches(total, position, batch_size, world, drop_last)):
        first = position + s * step + rank * batch_size
        out.append([p if p < total else PAD for p in range(first, first + batch_size)])
    return out


def rank_plan(order: np.ndarray, position: int, batch_size: int, world: int, rank: int,
              drop_last: bool) -> list[list[int]]:
    """This rank's batches from ``position`` on, as global sample ids (PAD for padding)."""
    batches = rank_batches(len(order), position, batch_size, world, rank, drop_last)
    return [[int(order[p]) if p != PAD else PAD for p in b] for b in batches]


def skip_ahead(rank_items: list[T], skip: int) -> list[T]:
    """A rank's items of an epoch after its first ``skip`` (a ``DistributedSampler`` order: rank
    ``r`` holds positions ``r, r+W, ...``, so global position ``p`` is ``p // W`` items in)."""
    return rank_items[skip:]


@dataclass(frozen=True)
class EpochSplit:
    """The step arithmetic of one epoch: ``total`` positions, ``batch_size`` per rank, ``world`` ranks."""

    total: int
    batch_size: int
    world: int
    drop_last: bool

    @property
    def step(self) -> int:
        """Positions one global step consumes."""
        return self.batch_size * self.world

    def batches(self) -> int:
        """Batches per rank in a whole epoch."""
        return remaining_batches(self.total, 0, self.batch_size, self.world, self.drop_last)

    def batches_before(self, position: int) -> int:
        """Batches per rank that global position ``position`` counts as done: counted back from the
        end, since at another world size it need not fall on one of this split's step boundaries."""
        return self.batches() - remaining_batches(self.total, position, self.batch_size, self.world, self.drop_last)


# ---------------------------------------------------------------- the position (a mixin of every training loader)


class Position:
    """Epoch, batches done and global position of a training loader, with the pass rules above.

    A loader sets ``_split`` (:class:`EpochSplit`) and may extend :meth:`_rewind`. ``position``
    is ``_start`` (where the current pass began, or the restored position) plus the steps since.
    """

    _split: EpochSplit
    epoch: int = 0
    batches_done: int = 0
    _start: int = 0  # global position the current pass started from
    _start_done: int = 0  # batches_done then
    _placed: bool = True  # the position was set on purpose: the next iter() starts there
    _pass: int = 0  # the current pass; an older iterator that is resumed later stops at once

    def __len__(self) -> int:
        """Batches per rank per epoch."""
        return self._split.batches()

    @property
    def position(self) -> int:
        """Global positions of this epoch's order consumed by all ranks together."""
        return min(self._split.total, self._start + (self.batches_done - self._start_done) * self._split.step)

    def _rewind(self) -> None:
        """Back to the first batch of ``self.epoch`` (a subclass resets more here)."""
        self.batches_done, self._start, self._start_done = 0, 0, 0

    def seek(self, position: int) -> None:
        """Skip ahead: the next pass over this epoch starts at global position ``position``
        (saved at any world size); ``batches_done`` counts what that leaves out."""
        self._start = position
        self.batches_done = self._start_done = self._split.batches_before(position)

    def _seek_batches(self, batches_done: int) -> None:
        """Skip ahead by a count of this world's batches (a state saved as ``batches_done``)."""
        self.batches_done = self._start_done = batches_done
        self._start = batches_done * self._split.step

    def _mark_start(self) -> None:
        """A pass begins where the position is."""
        self._start, self._start_done = self.position, self.batches_done

    def position_state(self) -> dict[str, Any]:
        """The position keys of a loader's ``state_dict``."""
        return {"epoch": self.epoch, "position": self.position, "batches_done": self.batches_done,
                "world_size": self._split.world}

    # passes ------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """The next pass is ``epoch``: from its first batch, or, when the loader is in ``epoch``
        already, from ``batches_done`` on (the training loop's protocol: a restored position, or
        the rest of an epoch that ``train.max_steps`` cut short)."""
        if epoch != self.epoch:
            self.epoch = epoch
            self._rewind()
        self._placed = True

    def _place(self) -> None:
        """The position was just restored: the next iter() continues from it."""
        self._placed = True

    def _begin_pass(self) -> int:
        if not self._placed:  # a pass of this epoch ran (in whole or in part): this one is the next epoch
            self.epoch += 1
            self._rewind()
        self._placed = False
        self._pass += 1
        return self._pass

    def _current(self, token: int) -> bool:
        """Whether the pass ``token`` is still the loader's (no newer ``iter()`` began)."""
        return token == self._pass

    def _end_pass(self, token: int) -> None:
        """The pass ran to its end: the next iter() starts the next epoch."""
        if self._current(token):
            self.epoch += 1
            self._rewind()
            self._placed = True


def check_same_order(state: dict[str, Any], mine: dict[str, Any]) -> None:
    """A saved position points into the order its (data, seed, shuffle) made: refuse another."""
    for key, value in mine.items():
        if key in state and state[key] != value:
            raise ValueError(f"loader state has {key}={state[key]!r} but this loader has {value!r}: the saved "
                             "position would point into another order; hint: resume with the same data and seed")
