"""The in-memory loaders: DistributedSampler order, resumable mid-epoch, workers or not, over an ArrayDataset
or any map-style dataset (a TensorDataset, a user's own class), also on a real 2-rank gloo group."""

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset, TensorDataset

from hpctrain.core.env import ClusterEnv
from hpctrain.core.errors import UserError
from hpctrain.data.in_memory import EvalLoader, MemoryLoader
from hpctrain.data.synthetic import synthetic
from tests.dist_utils import run_ranks


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


# ---------------------------------------------------------------- any map-style dataset


class Pairs(Dataset):
    """A user's own map-style dataset: (tensor, int) items, no __getitems__."""

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        self.inputs, self.targets = inputs, targets

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.inputs[i], int(self.targets[i])


def _datasets(n: int) -> dict[str, Dataset]:
    ref = synthetic("train", n, (4,), seed=2)
    return {"array": ref, "tensor": TensorDataset(ref.inputs, ref.targets), "own": Pairs(ref.inputs, ref.targets)}


def _batches(loader, epoch=None, limit=None):
    """(keys, inputs, targets) per batch."""
    if epoch is not None:
        loader.set_epoch(epoch)
    out = []
    for batch in loader:
        out.append((batch.keys.tolist(), batch.inputs, batch.targets))
        if limit is not None and len(out) == limit:
            break
    return out


def _same(a, b) -> bool:
    return len(a) == len(b) and all(ka == kb and torch.equal(xa, xb) and torch.equal(ya, yb)
                                    for (ka, xa, ya), (kb, xb, yb) in zip(a, b))


@pytest.mark.parametrize("workers", [0, 2])
def test_any_map_style_dataset_gives_the_array_datasets_batches(workers):
    data = _datasets(100)
    for env in (ClusterEnv(), ClusterEnv(rank=1, world_size=2)):
        ref = _batches(MemoryLoader(data["array"], env, 8, seed=4, num_workers=workers), epoch=1)
        evals = [list(EvalLoader(d, env, 7)) for d in data.values()]
        for name in ("tensor", "own"):
            got = _batches(MemoryLoader(data[name], env, 8, seed=4, num_workers=workers), epoch=1)
            assert _same(got, ref), name
            assert got[0][2].dtype == torch.int64  # int targets collate to int64, as ArrayDataset's
        for other in evals[1:]:
            assert _same([(b.keys.tolist(), b.inputs, b.targets) for b in other],
                         [(b.keys.tolist(), b.inputs, b.targets) for b in evals[0]])
    template = EvalLoader(data["own"], ClusterEnv(), 7).template()
    assert template.inputs.shape == (1, 4) and template.keys.tolist() == [0]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("name", ["tensor", "own"])
def test_resume_of_any_dataset_gives_the_remaining_batches(name, workers):
    data = _datasets(100)[name]
    full = _batches(MemoryLoader(data, ClusterEnv(), 8, seed=1, num_workers=workers), epoch=2)
    first = MemoryLoader(data, ClusterEnv(), 8, seed=1, num_workers=workers)
    head = _batches(first, epoch=2, limit=5)
    resumed = MemoryLoader(data, ClusterEnv(), 8, seed=1, num_workers=workers)
    resumed.load_state_dict(first.state_dict())
    assert _same(head + _batches(resumed), full) and len(full) == 100 // 8


def _two_rank_pass(env: ClusterEnv, n_train: int, n_eval: int) -> dict[str, dict[str, list[int]]]:
    """Every loader over every kind of dataset on this rank; counts per sample summed over the group."""
    import torch.distributed as dist

    out: dict[str, dict[str, list[int]]] = {}
    for name, data in _datasets(n_train).items():
        train = MemoryLoader(data, env, 8, seed=3)
        train.set_epoch(1)
        evaluation = EvalLoader(_datasets(n_eval)[name], env, 7)
        out[name] = {}
        for kind, loader, n in (("train", train, n_train), ("eval", evaluation, n_eval)):
            keys = [k for batch in loader for k in batch.keys.tolist()]
            seen = torch.bincount(torch.tensor(keys, dtype=torch.long), minlength=n)
            dist.all_reduce(seen)  # over the real group: how often each sample was read by any rank
            out[name][kind] = keys
            out[name][f"{kind}_seen"] = seen.tolist()
    return out


def test_any_dataset_on_two_gloo_ranks_reads_every_sample_once():
    n_train, n_eval = 96, 101  # 96 = 2 ranks x 6 batches of 8; 101 evaluates as 50 + 51
    ranks = run_ranks(2, _two_rank_pass, n_train, n_eval)
    for name in ("array", "tensor", "own"):
        assert ranks[0][name]["train_seen"] == [1] * n_train, name
        assert ranks[0][name]["eval_seen"] == [1] * n_eval, name
        assert [len(r[name]["train"]) for r in ranks] == [48, 48]
        assert [len(r[name]["eval"]) for r in ranks] == [50, 51]
        assert [r[name]["eval"] for r in ranks] == [list(range(50)), list(range(50, 101))]
        assert [r[name]["train"] for r in ranks] == [r["array"]["train"] for r in ranks]  # the same order


def test_datasets_the_loaders_cannot_read_are_named():
    class Records(Dataset):
        def __len__(self) -> int:
            return 4

        def __getitem__(self, i: int) -> dict[str, int]:
            return {"x": i}

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(3))

    with pytest.raises(UserError, match=r"Records\[0\] has none of the usual label keys .* it has \['x'\]; "
                                        r"hint: set data.label_key=KEY"):
        next(iter(EvalLoader(Records(), ClusterEnv(), 2)))
    with pytest.raises(UserError, match="Stream is not a map-style dataset"):
        MemoryLoader(Stream(), ClusterEnv(), 2)
