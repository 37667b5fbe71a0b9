"""What a DataLoader worker of the shard loaders sends (issue 18, point 5): numpy arrays and lists
(a PackedBatch, pickled into the pipe), not torch tensors (a shared-memory segment and a descriptor
hand-over each); the main process unpacks them into the very batches one process reads."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

import hpctrain.data.decode as decode_module
import hpctrain.data.shard_dataset as shard_dataset_module
import hpctrain.data.workers as workers_module
from hpctrain.core.env import ClusterEnv
from hpctrain.data.batch import PackedBatch
from hpctrain.data.loader import ShardedEvalLoader, ShardedLoader
from hpctrain.data.position import PAD
from hpctrain.data.shard_dataset import ShardDataset
from hpctrain.data.shard_index import ShardIndex
from tests.data.test_shards import flip_byte, make_shards, pixels


@pytest.fixture(scope="module")
def png_shards(tmp_path_factory):
    """20 PNG samples in shards of 6; sample s00004's pixels are corrupt (CRC mismatch)."""
    root = make_shards(tmp_path_factory.mktemp("png"), n=20, per_shard=6, kind="png")
    import json

    index = json.loads((root / "train-000000.idx.json").read_text())
    flip_byte(root / "train-000000.tar", index["start"][4] + index["offsets"][4][2] + 20)
    return root


def _as_worker(monkeypatch) -> None:
    for module in (shard_dataset_module, workers_module):  # what a DataLoader worker sees
        monkeypatch.setattr(module, "get_worker_info", lambda: object())


def _no_tensors(packed: PackedBatch) -> bool:
    return not any(isinstance(v, torch.Tensor) for v in vars(packed).values())


def _same(a, b) -> bool:
    same_mask = (a.mask is None and b.mask is None) or (a.mask is not None and b.mask is not None
                                                        and torch.equal(a.mask, b.mask))
    return (torch.equal(a.inputs, b.inputs) and a.inputs.dtype == b.inputs.dtype and torch.equal(a.targets, b.targets)
            and a.targets.dtype == b.targets.dtype and list(a.keys) == list(b.keys) and same_mask)


def test_a_worker_sends_uint8_pixels_and_lists_that_unpack_to_the_batch(png_shards, monkeypatch):
    ds = ShardDataset(ShardIndex(png_shards, "train"), on_corrupt="skip")
    ids = [3, 0, 4, 11, PAD]  # a corrupt sample (skipped, masked) and a padding slot
    want = ds.__getitems__(ids)  # one process: a Batch
    _as_worker(monkeypatch)
    sent = ds.__getitems__(ids)
    assert isinstance(sent, PackedBatch) and _no_tensors(sent)
    assert sent.inputs.dtype == np.uint8 and sent.inputs.shape == (5, 8, 8)  # raw pixels: a quarter of the floats
    got = pickle.loads(pickle.dumps(sent)).unpack()
    assert _same(got, want)
    assert got.keys == ["s00003", "s00000", "s00004", "s00011", ""] and got.mask.tolist() == [1, 1, 0, 1, 0]
    assert torch.equal(got.inputs[0, 0], torch.from_numpy(pixels(3)).float() / 255.0)


def test_a_transform_s_tensors_travel_as_numpy_unless_numpy_lacks_the_dtype(png_shards, monkeypatch):
    index = ShardIndex(png_shards, "train")
    tokens = ShardDataset(index, transform=lambda s: (torch.from_numpy(s["png"][0].astype(np.int64)), s["cls"]))
    halves = ShardDataset(index, transform=lambda s: (torch.ones(2, dtype=torch.bfloat16), s["cls"]))
    want_tokens, want_halves = tokens.batch([1, 2]), halves.batch([1, 2])
    _as_worker(monkeypatch)
    sent = tokens.__getitems__([1, 2])
    assert _no_tensors(sent) and sent.inputs.dtype == np.int64
    assert _same(pickle.loads(pickle.dumps(sent)).unpack(), want_tokens)
    sent = halves.__getitems__([1, 2])  # numpy has no bfloat16: the tensor travels as before
    assert isinstance(sent.inputs, torch.Tensor) and _same(pickle.loads(pickle.dumps(sent)).unpack(), want_halves)


@pytest.mark.parametrize("spng", [False, None])  # PIL, and libspng where pyspng is installed
def test_workers_give_the_batches_of_one_process(png_shards, spng, monkeypatch):
    monkeypatch.setattr(decode_module, "_SPNG", spng)

    def train(workers):
        return list(ShardedLoader(png_shards, ClusterEnv(), 3, seed=2, drop_last=False, on_corrupt="skip",
                                  num_workers=workers, persistent_workers=False))

    def val(workers):
        return list(ShardedEvalLoader(png_shards, ClusterEnv(), 4, split="train", on_corrupt="skip",
                                      num_workers=workers))

    for read in (train, val):
        one, two = read(0), read(2)
        assert len(one) == len(two) == (7 if read is train else 5)
        assert all(_same(a, b) for a, b in zip(one, two))
        assert sum(0 if b.mask is None else int((~b.mask).sum()) for b in two) >= 1  # the skipped sample
