"""The memory breakdown (hpctrain/telemetry/memory_breakdown.py, footprint.py, measure.py): bytes
saved for backward counted once per storage while held, parameters left out; the probe's
parameters / gradients / optimizer state / activations after the first optimizer step, with
accumulation, ZeRO-1 and DeepSpeed ZeRO-3 on gloo ranks, and in ``hpctrain train``'s summary."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from hpctrain.config import load_config
from hpctrain.telemetry.footprint import state_bytes
from hpctrain.telemetry.measure import SavedTensorMeter
from hpctrain.telemetry.memory_breakdown import MemoryProbe
from hpctrain.train import train
from tests.dist_utils import run_ranks

F32 = 4


def test_saved_bytes_count_each_storage_once_and_free_in_backward():
    x = torch.randn(8, 16, requires_grad=True)
    with SavedTensorMeter() as meter:
        y = x.exp()  # saves its result: 8 x 16 floats
        z = y[:, :8].sin() + y[:, 8:].cos()  # two views of y's storage: not counted again
        loss = z.sum()
    assert meter.peak == meter.live == 8 * 16 * F32
    loss.backward()
    assert meter.live == 0 and meter.peak == 8 * 16 * F32


def test_a_not_yet_waited_collective_counts_as_its_inner_tensor():
    """A tensor-parallel all-reduce returns an AsyncCollectiveTensor: a wrapper without storage."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    inner = torch.randn(8, 16, requires_grad=True).exp()
    with SavedTensorMeter() as meter:
        wrapped = AsyncCollectiveTensor(inner)
        (wrapped * inner).sum()  # mul saves both operands
    assert meter.peak == 8 * 16 * F32  # one storage, saved twice: once through the wrapper


def test_saved_parameters_are_not_activations():
    layer = nn.Linear(16, 4, bias=False)
    inputs = torch.randn(8, 16, requires_grad=True)
    with SavedTensorMeter() as meter:
        out = torch.tanh(layer(inputs))  # the matmul saves the input and weight.t(); tanh its output
    assert meter.peak == (8 * 16 + 8 * 4) * F32  # the weight (a view of a Parameter) left out
    out.sum().backward()
    assert meter.live == 0


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def _one_forward_saved_bytes(model: nn.Module, batch: torch.Tensor) -> int:
    with SavedTensorMeter() as meter:
        model(batch).square().mean()
    return meter.peak


def test_probe_breaks_down_the_first_step_and_counts_one_micro_batch_under_accumulation():
    model = _mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    probe = MemoryProbe()
    probe.arm(model, optimizer)
    batches = torch.randn(3, 8, 16)
    for step in range(3):
        for micro in range(2):  # two micro-batches per step: their saved tensors never overlap
            (model(batches[step][micro * 4:(micro + 1) * 4]).square().mean() / 2).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        probe.after_step()
    numel = sum(p.numel() for p in model.parameters())
    (row,) = probe.summary()["memory_breakdown"]
    assert row == {"rank": 0, "params_bytes": numel * F32, "grads_bytes": numel * F32,
                   "optimizer_bytes": 2 * numel * F32 + 4 * F32,  # m and v, and AdamW's 4 step counters
                   "activations_bytes": _one_forward_saved_bytes(model, batches[0][:4]), "gathered_bytes": 0}
    model(batches[0]).sum()  # after the first step nothing is counted any more
    assert probe._meter is not None and probe._meter.live == 0
    assert not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks  # removed


def test_probe_never_armed_reports_nothing_and_runs_no_collective():
    probe = MemoryProbe()
    probe.after_step()
    probe.disarm()
    assert probe.summary() == {}


def _zero1_breakdown(env) -> dict:
    from hpctrain.config.parallel import ParallelConfig
    from hpctrain.parallel.ddp import wrap_ddp
    from hpctrain.parallel.zero import zero1_from

    model = wrap_ddp(_mlp(), ParallelConfig())
    optimizer = zero1_from(torch.optim.AdamW(model.parameters(), lr=0.01))
    probe = MemoryProbe()
    probe.arm(model, optimizer)
    model(torch.randn(4, 16)).sum().backward()
    optimizer.step()
    probe.after_step()
    return probe.summary()


def test_zero1_ranks_share_the_optimizer_state_and_gather_every_rank_breakdown():
    ranks = run_ranks(2, _zero1_breakdown)
    rows = ranks[0]["memory_breakdown"]
    assert ranks[1]["memory_breakdown"] == rows and [r["rank"] for r in rows] == [0, 1]
    numel = sum(p.numel() for p in _mlp().parameters())
    assert all(r["params_bytes"] == r["grads_bytes"] == numel * F32 for r in rows)
    # each rank holds m, v and step for its parameters only: together exactly one process's state
    assert sum(r["optimizer_bytes"] for r in rows) == 2 * numel * F32 + 4 * F32
    assert all(r["optimizer_bytes"] < 2 * numel * F32 for r in rows)


def _deepspeed3_bytes(env) -> dict:
    from hpctrain.parallel.deepspeed import init_deepspeed

    torch.manual_seed(0)
    # 1 x 131,072 weights: over DeepSpeed's stage3_param_persistence_threshold (1e5), so partitioned;
    # 8 biases under it: kept whole on every rank
    model = nn.Sequential(nn.Linear(512, 256, bias=False), nn.Tanh(), nn.Linear(256, 8))
    engine = init_deepspeed(model, torch.optim.AdamW(model.parameters(), lr=0.01), env=env, stage=3, micro_batch=4)
    loss = engine(torch.randn(4, 512)).square().mean()
    engine.backward(loss)
    engine.step()
    return state_bytes(engine)


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="the deepspeed extra is not installed")
def test_deepspeed_zero3_counts_partitions_and_the_parameters_it_keeps_whole():
    numel = 512 * 256 + 256 * 8 + 8
    for rank in run_ranks(2, _deepspeed3_bytes, timeout=300):
        # each rank's partition (param.ds_tensor: half of everything) and the small ones it keeps whole
        assert rank["params"] == (numel // 2 + 256 * 8 + 8) * F32
        # m and v of the partition and one step counter, plus the fp32 master partition unless DeepSpeed
        # reuses the (already fp32) parameter partition as the master (it does for this model, not the GPT)
        assert rank["optimizer"] in (2 * numel // 2 * F32 + F32, 3 * numel // 2 * F32 + F32)


def test_train_summary_has_the_memory_breakdown(tmp_path):
    """``hpctrain train``: summary.json's ``memory_breakdown`` (needs the loop to arm the probe)."""
    cfg = load_config(None, ["model.name=tests.user_models:tiny_mlp", "data.name=synthetic_tiny",
                             "data.synthetic_size=64",
                             "data.batch_size=16", "train.progress=false", "train.threads=1", "train.max_steps=2",
                             "data.max_val_samples=16", "checkpoint.enabled=false", f"run.dir={tmp_path / 'run'}"])
    (row,) = train(cfg)["memory_breakdown"]
    assert row["rank"] == 0 and row["params_bytes"] == row["grads_bytes"] > 0
    assert row["optimizer_bytes"] > 0 and row["activations_bytes"] > 0  # SGD with momentum: one buffer per param
