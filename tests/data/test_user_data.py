"""Data as users have it (in-process; a loader's rank is its ClusterEnv, no process group):
``data.name=package.module:NAME`` with map-style datasets, dict items, a collate, streams and
Hugging Face datasets; integer inputs stay integer; every sample once per epoch across ranks, an
exact mid-epoch resume at another world size, exact validation; every loader restarts on
``iter()``; bad data exits 2 naming the sample."""

from __future__ import annotations

import logging
from collections import Counter
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hpctrain.cli import main
from hpctrain.config import load_config
from hpctrain.config.data import DataConfig
from hpctrain.core.env import ClusterEnv
from hpctrain.core.errors import UserError
from hpctrain.data import build_data
from hpctrain.data.in_memory import MemoryLoader
from hpctrain.data.loader import ShardedLoader
from hpctrain.data.synthetic import synthetic
from hpctrain.train import train

CPU = torch.device("cpu")
MOD = "tests.data.user_datasets"


def _bundle(name: str, world: int = 1, rank: int = 0, **keys: Any) -> Any:
    data = DataConfig(name=f"{MOD}:{name}", batch_size=keys.pop("batch_size", 4), **keys)
    return build_data(data, ClusterEnv(rank=rank, world_size=world), CPU, seed=5)


def _real(batch: Any) -> list[int]:
    """The keys of a batch's real samples (padding is masked)."""
    keys = batch.keys if isinstance(batch.keys, list) else batch.keys.tolist()
    return keys if batch.mask is None else [k for k, m in zip(keys, batch.mask.tolist()) if m]


def _take(loader: Any, n: int | None = None) -> list[int]:
    return [k for batch in islice(loader, n) for k in _real(batch)]


# ---------------------------------------------------------------- 1. integer inputs stay integer


def test_integer_inputs_stay_integer_from_shards_and_user_data(tmp_path: Path, capsys) -> None:
    np.savez(tmp_path / "tok.npz", x=np.arange(60, dtype=np.int32).reshape(12, 5), y=np.arange(12) % 3)
    np.savez(tmp_path / "flt.npz", x=np.ones((12, 5), dtype=np.float64), y=np.arange(12) % 3)
    for name, dtype in (("tok", torch.int64), ("flt", torch.float32)):
        assert main(["data", "shard", f"npz:{tmp_path / name}.npz", str(tmp_path / name), "--quiet"]) == 0
        batch = next(iter(ShardedLoader(tmp_path / name, ClusterEnv(), 4)))
        assert batch.inputs.dtype == dtype, name
    tokens = _bundle("make_tokens")
    assert tokens.input_dtype == torch.int64 and next(iter(tokens.train_loader)).inputs.dtype == torch.int64
    # an Embedding takes them as they come (float ids would fail in its forward)
    summary = train(load_config(None, [f"model.name={MOD}:token_model", f"data.name={MOD}:make_tokens",
                                       "data.batch_size=8", "train.progress=false", "checkpoint.enabled=false",
                                       f"run.dir={tmp_path / 'run'}"]))
    assert summary["steps"] == 4


# ---------------------------------------------------------------- 2. map-style: plan, resume, validation


def test_map_style_every_sample_once_and_an_exact_resume_at_another_world_size() -> None:
    two = [_bundle("make", 2, r, drop_last=False).train_loader for r in range(2)]
    assert [len(loader) for loader in two] == [7, 7]  # 50 samples, 8 a global step: the last one padded
    whole = [k for loader in two for k in _take(loader)]
    assert sorted(whole) == list(range(50))  # every sample once, padding masked
    head = [k for loader in two for k in _take(loader, 3)]  # 3 of 7 steps, then a checkpoint...
    state = two[0].state_dict()
    assert state["position"] == 24
    three = [_bundle("make", 3, r, drop_last=False).train_loader for r in range(3)]
    for loader in three:
        loader.load_state_dict(state)  # ...resumed at 3 ranks with rank 0's state, as the checkpointer does
    tail = [k for loader in three for k in _take(loader)]
    assert Counter(head + tail) == Counter(range(50))
    assert [loader.epoch for loader in three] == [2, 2, 2]  # epochs 0 and 1 ran whole: the next pass is 2


def test_drop_last_drops_one_partial_global_step_and_validation_is_exact() -> None:
    ranks = [_bundle("make", 3, r) for r in range(3)]
    taken = [k for b in ranks for k in _take(b.train_loader)]
    assert len(taken) == len(set(taken)) == 48  # 50 - 50 % (4 x 3)
    val = [k for b in ranks for batch in b.val_loader for k in batch.keys.tolist()]
    assert sorted(val) == list(range(21)) and [b.val_size for b in ranks] == [21] * 3


def test_dict_items_by_key_or_by_the_users_collate() -> None:
    plain = _bundle("make_records", batch_size=8)
    assert plain.input_shape == (6,) and plain.val_size == 9
    own = _bundle("make_records", batch_size=8, collate=f"{MOD}:collate_pairs")
    a, b = next(iter(plain.train_loader)), next(iter(own.train_loader))
    assert torch.equal(b.inputs, a.inputs * 2) and torch.equal(a.targets, b.targets)
    with pytest.raises(UserError, match=r"train\[\d+\] has no key 'pixels'; it has \['features', 'label', 'note'\]; "
                                        r"hint: set data.input_key=KEY"):
        _bundle("make_records", input_key="pixels")


def test_hugging_face_datasets_with_their_class_label() -> None:
    pytest.importorskip("datasets")
    bundle = _bundle("make_hf", batch_size=5)
    assert (bundle.num_classes, bundle.input_shape, bundle.train_size, bundle.val_size) == (3, (6,), 30, 7)
    assert sorted(_take(bundle.train_loader)) == list(range(30))


# ---------------------------------------------------------------- streams


def test_a_stateful_stream_splits_by_rank_and_resumes_exactly_at_another_world_size() -> None:
    two = [_bundle("make_stream", 2, r, drop_last=False) for r in range(2)]
    assert sorted(k for b in two for k in _take(b.train_loader)) == list(range(40))
    assert sorted(k for b in two for batch in b.val_loader for k in batch.keys.tolist()) == list(range(11))
    fresh = [_bundle("make_stream", 2, r, drop_last=False).train_loader for r in range(2)]
    head = [k for loader in fresh for k in _take(loader, 2)]
    state = fresh[0].state_dict()
    assert state["stream"] == {"next": 16}
    three = [_bundle("make_stream", 3, r, drop_last=False).train_loader for r in range(3)]
    for loader in three:
        loader.load_state_dict(state)
    assert Counter(head + [k for loader in three for k in _take(loader)]) == Counter(range(40))


def test_a_stream_without_state_restarts_its_epoch_and_says_so_once(caplog) -> None:
    loader = _bundle("make_plain_stream").train_loader
    _take(loader, 3)
    state = loader.state_dict()
    resumed = _bundle("make_plain_stream").train_loader
    with caplog.at_level(logging.WARNING, logger="hpctrain"):
        resumed.load_state_dict(state)
    assert sum(r.message.count("is not Stateful") for r in caplog.records) == 1
    assert "restarts epoch 0 from its first sample" in caplog.text
    assert _take(resumed) == list(range(40))


# ---------------------------------------------------------------- every loader restarts on iter()


def _loaders(tmp_path: Path) -> dict[str, Any]:
    np.savez(tmp_path / "a.npz", x=np.zeros((24, 3), dtype=np.float32), y=np.arange(24) % 2)
    assert main(["data", "shard", f"npz:{tmp_path / 'a.npz'}", str(tmp_path / "s"), "--quiet"]) == 0
    return {"memory": MemoryLoader(synthetic("train", 24, (3,)), ClusterEnv(), 4),
            "shards": ShardedLoader(tmp_path / "s", ClusterEnv(), 4),
            "user": _bundle("make").train_loader, "stream": _bundle("make_stream").train_loader}


def test_every_loader_restarts_on_each_iter(tmp_path: Path) -> None:
    for name, loader in _loaders(tmp_path).items():
        n = len(loader)
        orders = []
        for _ in range(3):  # a plain double `for epoch` loop over the same loader object
            orders.append([tuple(_real(b)) for b in loader])
            assert len(orders[-1]) == n, name
        stopped = [len(list(islice(iter(loader), n))) for _ in range(3)]  # Lightning: len() batches, never exhausted
        assert stopped == [n] * 3, name
        partial = [len(list(islice(iter(loader), 1))) for _ in range(2)] + [len(list(loader))]  # `break`, then again
        assert partial == [1, 1, n], name
        if name != "stream":  # a stream's order is its own
            assert orders[0] != orders[1], name  # each pass is the next epoch: a new order


# ---------------------------------------------------------------- bad data: exit 2, named


@pytest.mark.parametrize(("name", "says"), [
    ("make_strings", rf"data.name={MOD}:make_strings train\[\d+\] is a str, not an \(input, target\) pair; hint:"),
    ("make_bad_label", rf"data.name={MOD}:make_bad_label train\[5\] has label 7, outside \[0, 3\); hint: class ids"),
    # make_no_classes: the model's output width gives the count now (tests/test_user_code_errors.py)
    ("nothing_here", rf"data.name='{MOD}:nothing_here': module '{MOD}' has no 'nothing_here'"),
])
def test_bad_user_data_exits_2_naming_the_sample(tmp_path: Path, capsys, name: str, says: str) -> None:
    code = main(["train", f"model.name={MOD}:mlp", f"data.name={MOD}:{name}", "data.batch_size=20",
                 "train.progress=false", "checkpoint.enabled=false", f"run.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert __import__("re").search(says, err), err
