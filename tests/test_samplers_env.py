"""The samplers for a loop of your own, built before the process group (the world comes from the
launcher's environment), and LoopCheckpoint's mid-epoch resume surviving a stray ``iter()`` of
the loader (the PyTorch DDP tutorial's ``b_sz = len(next(iter(self.train_data))[0])``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import hpctrain
from hpctrain.data.sampler import EvalSampler, ResumableSampler

DATA = TensorDataset(torch.randn(40, 6, generator=torch.Generator().manual_seed(0)),
                     torch.randint(0, 3, (40,), generator=torch.Generator().manual_seed(1)))


def _launched(monkeypatch: pytest.MonkeyPatch, rank: int, world: int) -> None:
    """What torchrun sets for a rank, with no process group started yet."""
    for name, value in (("RANK", rank), ("WORLD_SIZE", world), ("LOCAL_RANK", rank), ("LOCAL_WORLD_SIZE", world)):
        monkeypatch.setenv(name, str(value))


def test_eval_sampler_before_the_group_takes_the_launchers_world(monkeypatch: pytest.MonkeyPatch) -> None:
    data = TensorDataset(torch.zeros(1001, 1))
    shares = []
    for rank in (0, 1):
        _launched(monkeypatch, rank, 2)
        shares.append(list(EvalSampler(data)))
    assert len(shares[0]) + len(shares[1]) == 1001  # not 2,002: each sample on one rank
    assert shares[0] + shares[1] == list(range(1001))


def test_resumable_sampler_before_the_group_takes_the_launchers_world(monkeypatch: pytest.MonkeyPatch) -> None:
    _launched(monkeypatch, 1, 2)
    sampler = ResumableSampler(DATA, seed=3)  # DistributedSampler itself raises without a group
    assert (sampler.num_replicas, sampler.rank) == (2, 1)
    assert list(sampler) == list(ResumableSampler(DATA, num_replicas=2, rank=1, seed=3))
    with pytest.raises(ValueError, match="rank 2 is not in"):
        ResumableSampler(DATA, rank=2)


def test_without_a_launcher_the_samplers_are_one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    assert list(EvalSampler(DATA)) == list(range(40))
    assert ResumableSampler(DATA).num_replicas == 1


class _Stop(Exception):
    pass


def _tutorial_loop(run_dir: Path, *, epochs: int = 2, stop_at: int | None = None) -> tuple[dict, int]:
    """The DDP tutorial's loop on one process with LoopCheckpoint, including its stray
    ``next(iter(loader))`` before ``set_epoch``; dropout makes the RNG streams matter."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = ResumableSampler(DATA, num_replicas=1, rank=0, seed=1)
    loader = DataLoader(DATA, batch_size=4, sampler=sampler)
    ckpt = hpctrain.LoopCheckpoint(run_dir, model, optimizer, None, loader, every_steps=3, every_seconds=None)
    trained = 0
    try:
        for epoch in range(ckpt.resume(first_epoch=0), epochs):
            b_sz = len(next(iter(loader))[0])  # the tutorial's line: a pass of its own
            assert b_sz == 4
            sampler.set_epoch(epoch)
            for source, targets in loader:
                optimizer.zero_grad()
                F.cross_entropy(model(source), targets).backward()
                optimizer.step()
                trained += 1
                if ckpt.counters.step == stop_at:
                    raise _Stop
    except _Stop:
        pass
    finally:
        ckpt.close()
    return {k: v.clone() for k, v in model.state_dict().items()}, trained


@pytest.mark.parametrize("stop_at", [5, 14])  # resumes at step 3 (epoch 0) and at step 12 (epoch 1)
def test_a_stray_iter_neither_loses_nor_repeats_the_resume_position(tmp_path: Path, stop_at: int) -> None:
    whole, steps = _tutorial_loop(tmp_path / "whole")
    assert steps == 20  # 2 epochs of 10 batches
    _, before = _tutorial_loop(tmp_path / "cut", stop_at=stop_at)
    resumed, after = _tutorial_loop(tmp_path / "cut")
    saved = stop_at // 3 * 3
    assert (before, after) == (stop_at, steps - saved)  # not the resumed epoch again from its start
    for name, value in whole.items():
        assert torch.equal(resumed[name], value), name  # same batches and dropout masks: bit for bit
