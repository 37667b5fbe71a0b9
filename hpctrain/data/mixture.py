"""Weighted mixtures of data sources (``data.mix``): one training order over several sources.

* **Interleave.** Global mixture position ``g`` (over the whole run: epoch ``e`` of the mixture,
  position ``p`` in it, ``g = e * N + p`` with ``N`` the weighted sources' samples) takes its
  source from block ``g // K`` of ``K`` positions: each block holds each source's share of
  ``K`` exactly (the cumulative counts ``floor(cut_s * n)`` at block ends, so the realised counts
  never drift more than one sample from the weights), in an order shuffled by (seed, block).
  So the source of ``g``, and how many samples that source gave before it, are a function of
  (seed, g) alone, computed without replaying the run: resume is exact at any world size
  (the loader's position is :mod:`~hpctrain.data.position`'s). ``K`` is 1024, or ``2 * 2^20 /``
  the smallest share in quanta (at most 2,097,152): one block held at a time, a few bytes a
  position, so the memory is linear in the sources and the block, never their product.
* **Bounds.** At most :data:`~hpctrain.config.mix.MAX_SOURCES` (1024) sources; weights finite,
  >= 0, with a finite sum > 0 (``data.mix`` refuses others with exit 2).
* **Sources.** Source ``s``'s ``j``-th sample is in its own epoch ``j // N_s``, at place
  ``j % N_s`` of its own :func:`~hpctrain.data.position.epoch_order` (a seed of its own): every
  source keeps its epoch counter and reshuffles when it wraps, whatever the others do.
* **Counts.** The samples each source gave are counted per global step (every rank counts
  every rank's positions, so no collective is needed), saved with the position, logged and
  written to ``summary.json``.
"""

from __future__ import annotations

import logging
import math
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch.utils.data import Dataset

from hpctrain.config.mix import MAX_SOURCES
from hpctrain.core.env import ClusterEnv
from hpctrain.data.batch import Batch
from hpctrain.data.loader import MapStyleLoader
from hpctrain.data.position import PAD, Shuffle, epoch_order, limit_order
from hpctrain.data.workers import WorkerError, in_worker

log = logging.getLogger("hpctrain")
STRIDE = 1 << 40  # a mixture sample's code: source * STRIDE + the source's sample id (PAD: -1)
QUANTUM = 1 << 20  # the weights as integer cuts of QUANTUM: exact integer arithmetic at any position
BLOCK = 1024  # positions per shuffled block (more when a share is below 1 / BLOCK)
MIX_TAG = 0x6D6978  # keeps the blocks' random streams apart from the epoch orders'


class Reader(Protocol):
    """A source's samples by id (PAD: a masked padding slot): IndexedBatches, ShardDataset."""

    def batch(self, ids: list[int]) -> Batch: ...


@dataclass
class MixSource:
    """One source of a mixture: how to read it and its own epoch order."""

    label: str
    weight: float
    reader: Reader
    sizes: list[int]  # consecutive parts (shards) that ``shuffle`` keeps together or not
    num_samples: int  # after data.max_train_samples
    seed: int  # the source's order; derived from the run's seed and the label
    shuffle: Shuffle = "shard"
    shuffle_window: int = 1000

    def order(self, epoch: int) -> np.ndarray:
        """The source's sample ids in its own epoch ``epoch``."""
        full = epoch_order(self.sizes, self.seed, epoch, self.shuffle, self.shuffle_window)
        return limit_order(full, self.num_samples)


def source_seed(seed: int, label: str) -> int:
    """A source's order seed: the run's seed and its label, so adding or reordering other sources keeps it."""
    return int(np.random.SeedSequence([seed, zlib.crc32(label.encode())]).generate_state(1)[0])


class Interleave:
    """Which source each global mixture position takes, and how many samples that source gave before it.

    Memory is linear in the sources and in one block: a block's sources are small integers in a
    seeded permutation, and each position's running index comes from one stable sort of them
    (never a positions x sources matrix). The block's length and its permutation are what fix
    the order, so they stay as they were: a saved position keeps its meaning."""

    def __init__(self, weights: Sequence[float], seed: int) -> None:
        total = check_weights(weights)
        shares = [int(round(w / total * QUANTUM)) for w in weights]
        shares = [max(s, 1) if w > 0 else 0 for s, w in zip(shares, weights)]
        shares[int(np.argmax(shares))] += QUANTUM - sum(shares)  # rounding: the largest source absorbs it
        if min(s for s, w in zip(shares, weights) if w > 0) <= 0:  # cannot happen within MAX_SOURCES
            raise ValueError(f"data.mix: {len(shares)} sources leave a source no share of {QUANTUM}; "
                             "hint: fewer sources, or weights nearer each other")
        self.cuts = [0, *np.cumsum(shares).tolist()]  # Python ints: exact at any position
        self.seed, self.sources = seed, len(shares)
        smallest = min(s for s in shares if s > 0)
        # every source with a weight gets >= 1 position per block, so no block count is negative
        self.block = max(BLOCK, -(-2 * QUANTUM // smallest))
        self._dtype = np.int16 if self.sources <= np.iinfo(np.int16).max else np.int32
        self._cached: tuple[int, np.ndarray, np.ndarray] | None = None  # (block, its sources, running indexes)

    def before(self, n: int) -> np.ndarray:
        """Samples of each source among positions [0, n), n a block boundary."""
        ends = [c * n // QUANTUM for c in self.cuts]
        return np.diff(np.asarray(ends, dtype=np.int64))

    def block_sources(self, b: int) -> np.ndarray:
        """The source of each position of block ``b``: each source's count, in a seeded order."""
        counts = self.before((b + 1) * self.block) - self.before(b * self.block)
        rng = np.random.Generator(np.random.PCG64([self.seed, MIX_TAG, b]))
        # a permutation draws the same swaps whatever the item size: int16 keeps the order of int64
        return rng.permutation(np.repeat(np.arange(self.sources, dtype=self._dtype), counts))

    def _block(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """Block ``b``'s sources and each position's count of earlier ones of its source (the last one kept:
        a loader reads one block over and over)."""
        if self._cached is None or self._cached[0] != b:
            self._cached = None  # one block held at a time
            block = self.block_sources(b)
            firsts = np.zeros(self.sources, dtype=np.int32)  # a block holds at most 2 * QUANTUM positions
            np.cumsum(np.bincount(block, minlength=self.sources)[:-1], out=firsts[1:])
            seen = np.empty(len(block), dtype=np.int32)
            # a stable sort lists each source's positions in position order: a position's place there,
            # less where its source begins, is how many of its source came before it in the block
            seen[np.argsort(block, kind="stable")] = np.arange(len(block), dtype=np.int32)
            seen -= firsts[block]
            self._cached = (b, block, seen)
        return self._cached[1], self._cached[2]

    def take(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """Positions [start, start + count): each one's source, and that source's running sample index."""
        src, run = [], []
        for b in range(start // self.block, -(-(start + count) // self.block)):
            block, seen = self._block(b)
            lo, hi = max(start - b * self.block, 0), min(start + count - b * self.block, self.block)
            part = block[lo:hi].astype(np.int64)
            src.append(part)
            run.append(self.before(b * self.block)[part] + seen[lo:hi])
        if not src:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        return np.concatenate(src), np.concatenate(run).astype(np.int64)

    def counts_before(self, g: int) -> np.ndarray:
        """Samples of each source among positions [0, g)."""
        b = g // self.block
        head = self._block(b)[0][: g - b * self.block] if g > b * self.block else np.zeros(0, dtype=self._dtype)
        return self.before(b * self.block) + np.bincount(head, minlength=self.sources)


def check_weights(weights: Sequence[float]) -> float:
    """The weights' total; a ValueError naming ``data.mix`` for weights that make no shares (config/mix.py
    refuses them first, with exit 2; this guards the part for a user's own loop)."""
    if len(weights) > MAX_SOURCES:
        raise ValueError(f"data.mix has {len(weights)} sources; at most {MAX_SOURCES} are supported")
    for i, w in enumerate(weights):
        if not math.isfinite(w) or w < 0:
            raise ValueError(f"data.mix[{i}].weight={w:g} must be a number >= 0 and finite")
    total = float(sum(weights))
    if not math.isfinite(total):
        raise ValueError(f"data.mix: the weights sum to more than a float holds ({total:g})")
    if total <= 0:
        raise ValueError(f"data.mix: the weights sum to {total:g}; at least one must be > 0")
    return total


def mixture_codes(interleave: Interleave, sources: Sequence[MixSource], start: int, count: int) -> np.ndarray:
    """The samples at global positions [start, start + count), as codes (source * STRIDE + id)."""
    src, run = interleave.take(start, count)
    codes = np.empty(len(src), dtype=np.int64)
    by_source = np.argsort(src, kind="stable")  # one sort, not a pass over the positions per source
    bounds = np.searchsorted(src[by_source], np.arange(len(sources) + 1))
    for s in np.nonzero(np.diff(bounds))[0].tolist():
        source, at = sources[s], by_source[bounds[s] : bounds[s + 1]]
        epochs, places = np.divmod(run[at], source.num_samples)
        for epoch in np.unique(epochs):  # a source wraps: its next epoch, reshuffled
            pick = epochs == epoch
            codes[at[pick]] = s * STRIDE + source.order(int(epoch))[places[pick]]
    return codes


class MixedDataset(Dataset):
    """Reads a batch of mixture codes: each source's samples by its reader, back in position order."""

    def __init__(self, sources: Sequence[MixSource]) -> None:
        self.readers = [s.reader for s in sources]
        self.labels = [s.label for s in sources]

    def __getitems__(self, codes: list[int]) -> Batch | WorkerError:
        return in_worker(self.batch, codes)

    def batch(self, codes: list[int]) -> Batch:
        arr = np.asarray(codes, dtype=np.int64)
        pad = arr < 0
        first = int(arr[~pad][0] // STRIDE) if (~pad).any() else 0
        src = np.where(pad, first, arr // STRIDE)
        ids = np.where(pad, PAD, arr % STRIDE)
        parts, where = [], []
        for s in np.unique(src):
            at = np.nonzero(src == s)[0]
            parts.append((int(s), self.readers[int(s)].batch(ids[at].tolist())))
            where.append(at)
        back = torch.as_tensor(np.argsort(np.concatenate(where), kind="stable"))
        return _joined(parts, back, self.labels)


def _joined(parts: list[tuple[int, Batch]], back: torch.Tensor, labels: list[str]) -> Batch:
    """Batches of several sources as one, ``back`` putting the rows in position order. Keys name
    the source (``label/key``); a padding slot's key is empty, a skipped bad sample's is not."""
    batches = [b for _, b in parts]
    if isinstance(batches[0].inputs, dict):
        inputs: Any = {k: torch.cat([b.inputs[k] for b in batches])[back] for k in batches[0].inputs}
    else:
        inputs = torch.cat([b.inputs for b in batches])[back]
    keys = [key for s, b in parts for key in _keys(b, labels[s])]
    masks = [b.mask if b.mask is not None else torch.ones(len(b), dtype=torch.bool) for b in batches]
    mask = torch.cat(masks)[back]
    return Batch(inputs, torch.cat([b.targets for b in batches])[back],
                 [keys[i] for i in back.tolist()], None if bool(mask.all()) else mask)


def _keys(batch: Batch, label: str) -> list[str]:
    raw = batch.keys.tolist() if isinstance(batch.keys, torch.Tensor) else list(batch.keys)
    return [f"{label}/{k}" if k not in ("", -1) else "" for k in raw]


class MixtureLoader(MapStyleLoader):
    """Training batches of a mixture for this rank: a :class:`MapStyleLoader` whose epoch order is
    the mixture's codes for global positions [epoch * N, (epoch + 1) * N)."""

    def __init__(self, sources: Sequence[MixSource], env: ClusterEnv, batch_size: int, *, seed: int = 0,
                 drop_last: bool = True, num_workers: int = 0, prefetch_factor: int = 2, pin_memory: bool = False,
                 persistent_workers: bool = True) -> None:
        self.sources = list(sources)
        self.interleave = Interleave([s.weight for s in self.sources], seed)
        self.counts = np.zeros(len(self.sources), dtype=np.int64)  # samples trained on, all ranks together
        self.skipped, self.skipped_keys = 0, []  # type: tuple[int, list[str]]
        self._codes: tuple[int, np.ndarray] | None = None
        epoch = sum(s.num_samples for s in self.sources if s.weight > 0)  # a weight-0 source is only validated
        super().__init__(MixedDataset(self.sources), [epoch], env, batch_size,
                         seed=seed, shuffle="none", drop_last=drop_last, num_workers=num_workers,
                         prefetch_factor=prefetch_factor, pin_memory=pin_memory,
                         persistent_workers=persistent_workers, what="data.mix")

    def order(self, epoch: int | None = None) -> np.ndarray:
        epoch = self.epoch if epoch is None else epoch
        if self._codes is None or self._codes[0] != epoch:
            total = self.num_samples
            self._codes = (epoch, mixture_codes(self.interleave, self.sources, epoch * total, total))
        return self._codes[1]

    def _seen(self, batch: Batch) -> None:
        """Count the sources of the global step just yielded (every rank's positions)."""
        after = self.position
        before = min(self._split.total, self._start + (self.batches_done - 1 - self._start_done) * self._split.step)
        if after > before:
            self.counts += np.bincount(self.order()[before:after] // STRIDE, minlength=len(self.sources))
        if batch.mask is not None:
            bad = [k for k, m in zip(batch.keys, batch.mask.tolist()) if not m and k]
            self.skipped += len(bad)
            self.skipped_keys += bad[: max(0, 100 - len(self.skipped_keys))]
        if self.batches_done == len(self) and self.env.is_main:  # the epoch's last batch (a loop may stop here)
            log.info("data.mix after epoch %d: %s", self.epoch, ", ".join(
                f"{label} {row['samples']} samples ({row['share']:.3f}, source epoch {row['epoch']})"
                for label, row in self.stats()["mix"].items()))

    def source_epochs(self) -> list[int]:
        """Each source's own epoch at the current position."""
        done = self.interleave.counts_before(self.epoch * self.num_samples + self.position)
        return [int(n // s.num_samples) for n, s in zip(done, self.sources)]

    def stats(self) -> dict[str, Any]:
        """Per source: its weight's share, the samples trained on (all ranks), their share, its epoch."""
        total = float(sum(s.weight for s in self.sources))
        seen = max(int(self.counts.sum()), 1)
        mix = {s.label: {"weight": s.weight / total, "samples": int(n), "share": int(n) / seen, "epoch": e}
               for s, n, e in zip(self.sources, self.counts, self.source_epochs())}
        return {"mix": mix, "skipped_samples": self.skipped, "skipped_keys": list(self.skipped_keys)}

    def _order_key(self) -> dict[str, Any]:
        key = super()._order_key()
        key["mix"] = [f"{s.label}:{s.weight:g}:{s.num_samples}" for s in self.sources]
        return key

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "mix_samples": self.counts.tolist(), "skipped_samples": self.skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.counts = np.asarray(state.get("mix_samples", [0] * len(self.sources)), dtype=np.int64)
        self.skipped = int(state.get("skipped_samples", 0))


class MixedEval:
    """The validation batches of every source in turn (an EvalBatches: the total); evaluation
    reads ``sources`` to give each source's metrics too."""

    def __init__(self, sources: list[tuple[str, Any]]) -> None:
        self.sources = sources  # (label, EvalBatches)

    def __len__(self) -> int:
        return sum(len(loader) for _, loader in self.sources)

    def __iter__(self) -> Iterator[Batch]:
        for _, loader in self.sources:
            yield from loader

    def template(self) -> Batch:
        template: Batch = self.sources[0][1].template()
        return template


def mix_summary(loader: object, last_eval: Any) -> dict[str, Any]:
    """A mixture's keys of ``summary.json`` (none for any other loader): ``mix``, per source its
    weight's share, the samples trained on, their share and its epoch; ``val_sources``, per source
    the last validation's metrics (``last_eval``: an EvalResult or None)."""
    if not isinstance(loader, MixtureLoader):
        return {}
    return {"mix": loader.stats()["mix"], "val_sources": getattr(last_eval, "sources", None) or None}


def mix_row(loader: object) -> dict[str, int]:
    """A mixture's per-source sample counts for a metrics row (``mix_samples/LABEL``)."""
    if not isinstance(loader, MixtureLoader):
        return {}
    return {f"mix_samples/{s.label}": int(n) for s, n in zip(loader.sources, loader.counts)}
