"""The one measurement module (hpctrain/telemetry/measure.py): FLOPs and saved-activation bytes
equal hand counts; the estimator, the planner and telemetry count through the same functions and
get the same numbers; and no other package module counts on its own."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

from hpctrain.cli.estimate import _measure
from hpctrain.config import load_config
from hpctrain.models import build_model
from hpctrain.planning import autosize
from hpctrain.telemetry import flops, measure
from hpctrain.telemetry.memory_breakdown import MemoryProbe

F32, F16 = 4, 2
ROOT = Path(__file__).resolve().parents[1]


def _linear_stack() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32, bias=False), nn.ReLU(), nn.Linear(32, 8, bias=False))


def test_training_flops_of_a_linear_stack_are_6_n_per_token():
    """Forward 2N per token, backward 4N (input and weight gradients): 6N, with N the weights."""
    model = measure.on_meta(_linear_stack)
    n, tokens = measure.param_count([model]), 5
    assert n == 16 * 32 + 32 * 8
    x = torch.empty(tokens, 16, device="meta", requires_grad=True)  # so the first layer's input gradient is run too
    counted = measure.train_flops(model, x)
    assert counted.total == 6 * n * tokens
    assert counted.by_module["Sequential.0"] == 6 * 16 * 32 * tokens  # by module: the planner tells blocks apart so


def test_parameter_and_buffer_bytes_are_counted_at_their_own_dtype_each_tensor_once():
    model = measure.on_meta(lambda: nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8)))
    model[0].half()
    assert measure.param_count([model, model[0]]) == 4 * 8 + 8 + 2 * 8  # the Linear's weights once
    assert measure.param_bytes(model) == (4 * 8 + 8) * F16 + 2 * 8 * F32
    assert measure.buffer_bytes(model) == 2 * 8 * F32 + 8  # running mean and variance, an int64 step count


class _ScaledViews(nn.Module):
    """Saves its input (for the scale's gradient) and ``y``; sin and cos then save two halves of ``y``."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = (x * self.scale).exp()
        return y[:, :8].sin() + y[:, 8:].cos()


def test_saved_bytes_count_each_storage_once_whole_as_memory_holds_them():
    """The case the estimator's own copy got wrong: it counted tensors by identity, so ``y``
    and its two views were three tensors (x + 2y); memory holds x and y once. The gpt saves
    views the same way (a Linear on a (B, T, H) input saves a 2-D view of a tensor saved whole
    elsewhere): `hpctrain estimate --model gpt` counted 6.96 MB per sample at fp32, now 5.39 MB,
    the planner's figure."""
    batch = 3
    model = measure.on_meta(_ScaledViews)
    assert measure.saved_tensor_bytes(model, (16,), batch) == 2 * batch * 16 * F32
    real = _ScaledViews()
    with measure.SavedTensorMeter(measure.parameter_storages(real)) as meter:
        real(torch.randn(batch, 16))
    assert meter.peak == 2 * batch * 16 * F32  # the meta count is what a real forward holds


class _HalfExp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.scale).half().exp()


def test_a_floating_tensor_is_never_counted_above_its_own_size():
    """The other case the estimator's copy got wrong: every floating tensor at ``element_bytes``,
    so an fp16 activation counted 4 bytes under an fp32 count; autocast only lowers precision
    (the planner's rule, now everyone's)."""
    model = measure.on_meta(_HalfExp)
    assert measure.saved_tensor_bytes(model, (16,), 2, element_bytes=F32) == 2 * 16 * (F32 + F16)
    assert measure.saved_tensor_bytes(model, (16,), 2, element_bytes=F16) == 2 * 16 * (F16 + F16)


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts the calls of the one FLOP counter and of the one saved-bytes rule."""
    seen = {"flops": 0, "saved": 0}
    count_flops, storage_bytes = measure.count_flops, measure.storage_bytes

    def counted_flops(run):  # type: ignore[no-untyped-def]
        seen["flops"] += 1
        return count_flops(run)

    def counted_bytes(tensor, element_bytes=None):  # type: ignore[no-untyped-def]
        seen["saved"] += 1
        return storage_bytes(tensor, element_bytes)

    monkeypatch.setattr(measure, "count_flops", counted_flops)
    monkeypatch.setattr(measure, "storage_bytes", counted_bytes)
    return seen


def _telemetry_activations(batch: int) -> int:
    """The run's memory breakdown after one real optimizer step of simple_cnn (a sum loss saves nothing)."""
    torch.manual_seed(0)
    model = build_model("simple_cnn")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    probe = MemoryProbe()
    probe.arm(model, optimizer)
    model(torch.randn(batch, 3, 32, 32)).sum().backward()
    optimizer.step()
    probe.after_step()
    (row,) = probe.summary()["memory_breakdown"]
    return int(row["activations_bytes"])


def test_estimator_planner_and_telemetry_count_with_the_same_functions(calls: dict[str, int]):
    estimated = _measure("simple_cnn", 2, F32)  # hpctrain estimate --model simple_cnn --micro-batch 2 --precision fp32
    assert calls == {"flops": 1, "saved": calls["saved"]} and calls["saved"] > 0
    planned = autosize.profile(load_config(None, ["model.name=simple_cnn", "precision=fp32"]))
    assert calls["flops"] == 2
    assert planned.flops_per_sample == estimated.flops_per_sample  # forward+backward per sample, both
    assert planned.params == estimated.params
    saved_before = calls["saved"]
    activations = _telemetry_activations(2)
    assert calls["saved"] > saved_before
    assert activations == estimated.activations  # a real step holds what the meta count predicts
    flops.forward_flops(build_model("simple_cnn"), torch.randn(2, 3, 32, 32))
    assert calls["flops"] == 3


def test_only_the_measurement_module_counts():
    """FlopCounterMode and saved_tensors_hooks appear in one package module: the others call it."""
    pattern = re.compile(r"FlopCounterMode|saved_tensors_hooks")
    users = sorted(str(path.relative_to(ROOT)) for path in (ROOT / "hpctrain").rglob("*.py")
                   if pattern.search(path.read_text(encoding="utf-8")))
    assert users == ["hpctrain/telemetry/measure.py"]
