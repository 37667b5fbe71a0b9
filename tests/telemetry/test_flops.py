"""FLOP counting against a hand count, the MFU convention, the CPU probe and its cache."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hpctrain.telemetry import flops
from hpctrain.telemetry.flops import Peak, forward_flops, mfu, peak_flops, train_step_flops


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def test_mlp_flops_equal_a_hand_count():
    batch = 8
    # 2 FLOPs per multiply-add: 2 * batch * in * out per Linear; bias adds and ReLU not counted
    forward = 2 * batch * 16 * 32 + 2 * batch * 32 * 4
    assert forward_flops(_mlp(), torch.randn(batch, 16)) == forward
    assert train_step_flops(_mlp(), torch.randn(batch, 16), grad_accum=2) == 3 * forward * 2


class _Attention(nn.Module):
    def forward(self, q: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, q, q, is_causal=True)


def test_causal_attention_counts_full_t_by_t():
    # PyTorch's own CPU kernel is invisible to FlopCounterMode; on meta it is two batched matmuls
    b, h, t, d = 2, 4, 64, 16
    assert forward_flops(_Attention(), torch.randn(b, h, t, d)) == 2 * (2 * b * h * t * t * d)


def test_counting_leaves_the_model_and_the_rng_untouched():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Dropout(0.5), nn.Flatten(), nn.Linear(8 * 36, 2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(4, 3, 8, 8)
    rng = torch.get_rng_state()
    count = forward_flops(model, x)
    assert count == 2 * 4 * 8 * 36 * 27 + 2 * 4 * 8 * 36 * 2  # conv (out positions x kernel MACs) + linear
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(rng, torch.get_rng_state())


class _DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum().item() > -1e9:  # .item() cannot run on meta: counted on a copy instead
            x = self.lin(x)
        return x


def test_models_that_cannot_run_on_meta_are_counted_on_a_copy():
    assert forward_flops(_DataDependent(), torch.randn(3, 4)) == 2 * 3 * 4 * 4


def test_cpu_mfu_is_in_zero_one(tmp_path):
    torch.manual_seed(0)
    model, x, y = _mlp(), torch.randn(64, 16), torch.randint(0, 4, (64,))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step_flops = train_step_flops(model, x)
    start, steps = time.perf_counter(), 20
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    seconds = (time.perf_counter() - start) / steps
    peak = peak_flops(torch.device("cpu"), "fp32", cache_dir=tmp_path)
    assert peak is not None and "probe" in peak.source
    assert 0.0 < mfu(step_flops, seconds, peak) <= 1.0


def test_cpu_probe_is_cached(tmp_path, monkeypatch):
    first = flops.cpu_matmul_peak(torch.float32, tmp_path)
    assert (tmp_path / "cpu_peak.json").exists() and first > 0

    def no_probe(*_: object) -> float:
        raise AssertionError("probed again despite the cache")

    monkeypatch.setattr(flops, "_probe", no_probe)
    assert flops.cpu_matmul_peak(torch.float32, tmp_path) == first


def test_override_and_accelerator_names():
    assert peak_flops(torch.device("cpu"), "bf16", override_tflops=2.5) == Peak(2.5e12, "telemetry.peak_tflops")
    assert flops.accelerator_key("NVIDIA H100 80GB HBM3") == "h100-sxm"
    assert flops.accelerator_key("NVIDIA H100 PCIe") == "h100-pcie"
    assert flops.accelerator_key("NVIDIA H200") == "h200"
    assert flops.accelerator_key("NVIDIA A100-SXM4-40GB") == "a100-40gb"
    assert flops.accelerator_key("NVIDIA A100-SXM4-80GB") == "a100"
    assert flops.accelerator_key("NVIDIA H100 NVL") == "h100-nvl"
    assert flops.accelerator_key("NVIDIA H800") == "h800"
    assert flops.accelerator_key("NVIDIA B200") == "b200"
    assert flops.accelerator_key("NVIDIA L40S") == "l40s"
    assert flops.accelerator_key("Tesla V100-SXM2-32GB") == "v100"
    assert flops.accelerator_key("AMD Instinct MI300X") == "mi300x"
    assert flops.accelerator_key("NVIDIA GeForce RTX 4090") is None


def test_mfu_divides_one_ranks_flops_by_one_device_peak():
    assert mfu(1e12, 2.0, Peak(1e12, "x")) == pytest.approx(0.5)
    assert mfu(1e12, 0.0, Peak(1e12, "x")) == 0.0


def test_simple_cnn_matches_a_hand_count():
    from hpctrain.models import build_model

    n = 2
    conv = [2 * n * c_out * hw * hw * c_in * 9 for c_in, c_out, hw in ((3, 64, 32), (64, 128, 16), (128, 256, 8))]
    linear = 2 * n * 4096 * 512 + 2 * n * 512 * 10
    assert forward_flops(build_model("simple_cnn"), torch.randn(n, 3, 32, 32)) == sum(conv) + linear


def test_transformer_step_matches_6n_tokens_plus_attention():
    # 6 N per token for the weights, + 12 L T d per token for the attention matmuls (PaLM's
    # 6N + 12LHQT): exact up to the norm and bias parameters, which do no matmul
    layers, d, t, b = 2, 64, 32, 3
    model = nn.Sequential(*[nn.TransformerEncoderLayer(d, 4, 4 * d, batch_first=True, dropout=0.0)
                            for _ in range(layers)])
    matmul_params = sum(p.numel() for name, p in model.named_parameters() if p.dim() == 2)
    tokens = b * t
    expected = 6 * matmul_params * tokens + 12 * layers * t * d * tokens
    assert train_step_flops(model, torch.randn(b, t, d)) == expected
