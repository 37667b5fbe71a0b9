"""The in-memory training loader: DistributedSampler order, resumable mid-epoch, workers or not."""

import pytest
import torch

from hpctrain.data.memory import MemoryLoader
from hpctrain.data.sources import synthetic
from hpctrain.env import ClusterEnv


def _keys(loader, epoch, limit=None):
    loader.set_epoch(epoch)
    out = []
    for batch in loader:
        out.append(batch.keys.tolist())
        if limit is not None and len(out) == limit:
            break
    return out


@pytest.mark.parametrize("workers", [0, 2])
def test_ranks_partition_the_single_process_batches(workers):
    data = synthetic("train", 96, (4,))
    single = _keys(MemoryLoader(data, ClusterEnv(), 16, seed=3, num_workers=workers), 1)
    ranks = [_keys(MemoryLoader(data, ClusterEnv(rank=r, world_size=2), 8, seed=3, num_workers=workers), 1)
             for r in range(2)]
    for i, big in enumerate(single):
        assert sorted(big) == sorted(ranks[0][i] + ranks[1][i])


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_mid_epoch_gives_the_remaining_batches(workers):
    data = synthetic("train", 100, (4,))
    full = _keys(MemoryLoader(data, ClusterEnv(), 8, seed=1, num_workers=workers), 2)
    first = MemoryLoader(data, ClusterEnv(), 8, seed=1, num_workers=workers)
    head = _keys(first, 2, limit=5)
    state = first.state_dict()
    assert state == {"epoch": 2, "batches_done": 5}
    resumed = MemoryLoader(data, ClusterEnv(), 8, seed=1, num_workers=workers)
    resumed.load_state_dict(state)
    tail = [b.keys.tolist() for b in resumed]
    assert head + tail == full and len(full) == 100 // 8  # drop_last: 12 full batches


def test_epochs_differ_and_len_counts_full_batches():
    loader = MemoryLoader(synthetic("train", 50, (4,)), ClusterEnv(), 8)
    assert len(loader) == 6
    assert _keys(loader, 0) != _keys(loader, 1)
    batch = next(iter(MemoryLoader(synthetic("train", 50, (4,)), ClusterEnv(), 8)))
    assert batch.inputs.shape == (8, 4) and batch.targets.dtype == torch.int64
