"""The resumable-position core (hpctrain.data.position) under the four loaders: the orders and
states are the ones recorded from the loaders before the core existed (so their checkpoints resume
exactly), skip-ahead equals iterating, states round-trip, and a resume at another world size
gives the same global sequence."""

from __future__ import annotations

import hashlib
import json
from collections import Counter

import pytest
import torch
from torch.utils.data import IterableDataset

from hpctrain.core.env import ClusterEnv
from hpctrain.data.batch import ArrayDataset, Batch, ItemDataset, ItemSpec
from hpctrain.data.in_memory import MemoryLoader
from hpctrain.data.loader import IndexedBatches, MapStyleLoader
from hpctrain.data.position import EpochSplit, epoch_order
from hpctrain.data.sampler import ResumableSampler
from hpctrain.data.user import StreamLoader

# Recorded from hpctrain.data.loader / memory / user / sampler at commit 3d3bae3 (before the core).
ORDER_7_3 = {  # epoch_order([5, 17, 0, 9, 30], seed=7, epoch=3, shuffle, window=4)
    "global": [39, 37, 48, 49, 13, 42, 57, 52, 59, 60, 31, 53, 50, 15, 55, 45, 3, 21, 35, 51],
    "shard": [26, 24, 27, 30, 29, 25, 28, 23, 22, 1, 2, 4, 0, 3, 34, 59, 45, 46, 55, 38],
    "window": [28, 26, 27, 29, 30, 24, 25, 23, 22, 4, 1, 2, 0, 3, 58, 55, 57, 56, 35, 36],
}
ORDER_HASHES = {("global", 0, 0): "b1d4159cda061d49", ("shard", 0, 3): "b0d3cd6a371d8f6f",
                ("window", 7, 0): "1412cdaf850c0438", ("none", 7, 3): "d0e794e10cc33c03"}
LOADER_HASHES = {  # every rank's keys of epoch 2 (47 samples, batch 4, seed 5), rank after rank; -1: padding
    ("map", 2, True): "72679b0719ad0db2", ("map", 2, False): "2882ef326658001e",
    ("memory", 1, True): "274a699e590c7f28", ("memory", 1, False): "e8def3f9f963a40c",
    ("memory", 3, True): "206577ed72f4936c", ("memory", 3, False): "206577ed72f4936c",
}
STREAM_HASHES = {(1, True): "de0b7325c09d8fcc", (2, True): "637ccd9aef2774cd", (2, False): "ee5a72d39b89ff1e"}
SAMPLER_HASHES = {(1, False): "a2f27a796ffbc87c", (3, False): "f82f7ffb96876c45", (3, True): "81ab286a6b1c4806"}
STATES = {  # after 3 batches of epoch 1 (64 samples, 8 per global step, seed 3), at 2 ranks
    "map": {"batches_done": 3, "epoch": 1, "num_samples": 64, "position": 24, "seed": 3, "shuffle": "shard",
            "shuffle_window": 1000, "world_size": 2},
    "memory": {"batches_done": 3, "epoch": 1},
}


def digest(seq) -> str:
    return hashlib.sha256(json.dumps([int(x) for x in seq]).encode()).hexdigest()[:16]


def data(n: int) -> ArrayDataset:
    return ArrayDataset(torch.arange(n, dtype=torch.float32).view(n, 1), torch.arange(n) % 3, 3, "t")


def env(rank: int, world: int) -> ClusterEnv:
    return ClusterEnv(rank=rank, world_size=world)


def keys(batches) -> list[int]:
    """Sample ids of batches, -1 for a masked slot."""
    out = []
    for b in batches:
        mask = b.mask.tolist() if b.mask is not None else [True] * len(b.keys)
        out += [int(k) if m else -1 for k, m in zip(b.keys.tolist(), mask)]
    return out


def map_loader(rank: int, world: int, batch: int, n: int = 47, seed: int = 5, **kw) -> MapStyleLoader:
    return MapStyleLoader(IndexedBatches(data(n)), [n], env(rank, world), batch, seed=seed, **kw)


def loader(kind: str, rank: int, world: int, batch: int, n: int, seed: int, **kw):
    if kind == "map":
        return map_loader(rank, world, batch, n, seed, **kw)
    return MemoryLoader(data(n), env(rank, world), batch, seed=seed, **kw)


class Stream(IterableDataset):
    """0..n-1, Stateful: resumes where its state says."""

    def __init__(self, n: int) -> None:
        self.n, self.next = n, 0

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        start, self.next = self.next, 0
        for i in range(start, self.n):
            self.next = i + 1
            yield torch.tensor([float(i)]), i % 3

    def state_dict(self) -> dict[str, int]:
        return {"next": self.next}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.next = state["next"]


def stream_loader(rank: int, world: int, batch: int, n: int = 23, **kw) -> StreamLoader:
    s = Stream(n)
    return StreamLoader(s, ItemDataset(s, ItemSpec("s")), env(rank, world), batch, **kw)


# ---------------------------------------------------------------- the orders are the recorded ones


@pytest.mark.parametrize("shuffle", sorted(ORDER_7_3))
def test_epoch_order_is_the_recorded_one(shuffle):
    assert epoch_order([5, 17, 0, 9, 30], 7, 3, shuffle, 4)[:20].tolist() == ORDER_7_3[shuffle]


@pytest.mark.parametrize("key", sorted(ORDER_HASHES))
def test_epoch_order_hashes_are_the_recorded_ones(key):
    shuffle, seed, epoch = key
    assert digest(epoch_order([5, 17, 0, 9, 30], seed, epoch, shuffle, 4)) == ORDER_HASHES[key]


@pytest.mark.parametrize("key", sorted(LOADER_HASHES))
def test_loader_orders_are_the_recorded_ones(key):
    kind, world, drop_last = key
    seq = []
    for r in range(world):
        one = loader(kind, r, world, 4, 47, 5, drop_last=drop_last)
        one.set_epoch(2)
        seq += keys(one)
    assert digest(seq) == LOADER_HASHES[key]


@pytest.mark.parametrize("key", sorted(STREAM_HASHES))
def test_stream_order_is_the_recorded_one(key):
    world, drop_last = key
    assert digest([k for r in range(world) for k in keys(stream_loader(r, world, 3, drop_last=drop_last))]) == \
        STREAM_HASHES[key]


@pytest.mark.parametrize("key", sorted(SAMPLER_HASHES))
def test_resumable_sampler_skip_is_the_recorded_one(key):
    world, drop_last = key
    seq = []
    for r in range(world):
        sampler = ResumableSampler(list(range(29)), num_replicas=world, rank=r, seed=4, drop_last=drop_last)
        sampler.set_epoch(1)
        sampler.resume_at(1, 3)
        seq += list(sampler)
    assert digest(seq) == SAMPLER_HASHES[key]


@pytest.mark.parametrize("kind", sorted(STATES))
def test_states_have_the_recorded_keys_and_values(kind):
    one = loader(kind, 0, 2, 4, 64, 3)
    one.set_epoch(1)
    it = iter(one)
    for _ in range(3):
        next(it)
    assert one.state_dict() == STATES[kind]


# ---------------------------------------------------------------- skip-ahead, round trip, elastic resume


@pytest.mark.parametrize("kind", ["map", "memory"])
@pytest.mark.parametrize("done", [0, 1, 4])
def test_restoring_a_recorded_state_continues_the_uninterrupted_batches(kind, done):
    """A checkpoint of the old loaders (a recorded state) skips exactly what the run had iterated."""
    for r in range(2):
        whole = loader(kind, r, 2, 4, 64, 3)
        whole.set_epoch(1)
        expect = keys(list(whole)[done:])
        state = {**STATES[kind], "batches_done": done}
        if kind == "map":
            state["position"] = done * 8
        resumed = loader(kind, r, 2, 4, 64, 3)
        resumed.load_state_dict(state)
        assert keys(resumed) == expect and resumed.epoch == 2


@pytest.mark.parametrize("drop_last", [True, False])
def test_seek_to_a_position_equals_iterating_to_it(drop_last):
    for p in (0, 8, 24, 40):
        ranks = [map_loader(r, 2, 4, drop_last=drop_last) for r in range(2)]
        for one in ranks:
            one.set_epoch(1)
        whole = [keys(one) for one in ranks]
        for r, one in enumerate(ranks):
            one.set_epoch(0)
            one.set_epoch(1)
            one.seek(p)
            assert one.batches_done == p // 8
            assert keys(one) == whole[r][p // 2:], (p, r)


def test_states_round_trip():
    for make in (lambda: map_loader(1, 2, 4), lambda: MemoryLoader(data(47), env(1, 2), 4, seed=5),
                 lambda: stream_loader(1, 2, 3)):
        one = make()
        it = iter(one)
        next(it), next(it)
        state = one.state_dict()
        other = make()
        other.load_state_dict(state)
        assert other.state_dict() == state and other.position == one.position


def test_a_stateful_stream_skips_ahead_to_its_saved_position():
    whole = keys(stream_loader(0, 2, 3))
    one = stream_loader(0, 2, 3)
    it = iter(one)
    next(it), next(it)
    state = one.state_dict()
    assert state["position"] == 12 and state["batches_done"] == 2
    other = stream_loader(0, 2, 3)
    other.dataset.load_state_dict(one.dataset.state_dict())  # the stream's own state travels in "stream"
    other.load_state_dict({**state, "stream": one.dataset.state_dict()})
    assert keys(other) == whole[6:]


def global_sequence(per_rank: list[list[Batch]]) -> list[int]:
    """The samples step by step, ranks in order within a step."""
    return [k for step in zip(*per_rank) for b in step for k in keys([b])]


@pytest.mark.parametrize("kind", ["map", "memory"])
def test_resume_at_another_world_size_gives_the_same_global_sequence(kind):
    """8 samples per global step at 2 x 4 and at 1 x 8 (data.global_batch_size): the steps after a
    resume hold the samples, in the order, of the uninterrupted run's."""
    two = [loader(kind, r, 2, 4, 64, 3) for r in range(2)]
    for one in two:
        one.set_epoch(1)
    whole = global_sequence([list(one) for one in two])
    saved = loader(kind, 0, 2, 4, 64, 3)
    saved.set_epoch(1)
    it = iter(saved)
    for _ in range(3):
        next(it)
    single = loader(kind, 0, 1, 8, 64, 3)
    single.load_state_dict(saved.state_dict())
    rest = keys(single)
    if kind == "map":
        assert rest == whole[24:]
    else:  # DistributedSampler's order: rank r holds positions r, r+W, ...; a step holds the same set
        steps = [sorted(rest[i : i + 8]) for i in range(0, 40, 8)]
        assert steps == [sorted(whole[i : i + 8]) for i in range(24, 64, 8)]


def test_resume_off_a_step_boundary_reads_the_rest_once():
    """Position 24 at 3 ranks x 4 (12 a step): the rest of the epoch, each sample once, padding masked."""
    saved = map_loader(0, 2, 4, n=64, seed=3)
    saved.set_epoch(1)
    it = iter(saved)
    for _ in range(3):
        next(it)
    order = saved.order().tolist()
    rest = Counter()
    for r in range(3):
        one = map_loader(r, 3, 4, n=64, seed=3, drop_last=False)
        one.load_state_dict(saved.state_dict())
        assert one.batches_done == EpochSplit(64, 4, 3, False).batches_before(24) == 2  # 6 batches, 4 left
        rest.update(k for k in keys(one) if k >= 0)
    assert rest == Counter(order[24:])
