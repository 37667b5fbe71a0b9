"""`hpctrain estimate`: published figures (GPT-3, ZeRO paper, 70B), hand counts, and bad inputs."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from hpctrain.cli import main
from hpctrain.cli.estimate import parse_count
from hpctrain.core.errors import UserError
from hpctrain.estimate import activations, reliability
from hpctrain.estimate import gpu_memory as memory
from hpctrain.models.shape import TransformerShape
from hpctrain.telemetry import accelerators as hardware
from hpctrain.telemetry import measure

GPT3 = TransformerShape(layers=96, hidden=12288, heads=96, seq_len=2048, vocab=50257)


def _estimate(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(["estimate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


# ---------------------------------------------------------------- published figures


def test_gpt3_175b_on_300b_tokens_is_3_14e23_flops_and_3640_pf_days(capsys):
    """Brown et al. 2020, table D.1: 3.14e23 FLOPs, 3,640 PF-days (from the shape's 174.6B params)."""
    shape_args = ["--layers", "96", "--hidden", "12288", "--heads", "96", "--seq-len", "2048", "--vocab", "50257"]
    out = _estimate(capsys, *shape_args, "--tokens", "300B")
    assert out["model"]["params"] == pytest.approx(174.6e9, rel=1e-3)
    assert f"{out['compute']['flops']:.2e}" == "3.14e+23"
    assert out["compute"]["pf_days"] == pytest.approx(3640, rel=1e-3)
    # the rounded count gives 6 x 175e9 x 300e9 exactly
    assert _estimate(capsys, "--params", "175B", "--tokens", "300e9")["compute"]["flops"] == pytest.approx(3.15e23)


def test_70b_model_is_140gb_in_bf16_and_its_fp32_adam_moments_560gb(capsys):
    bf16 = _estimate(capsys, "--params", "70B")["memory"]["strategies"]["ddp"]
    assert bf16["weights"] == pytest.approx(140e9)
    assert bf16["optimizer"] == pytest.approx(70e9 * (4 + 8))  # fp32 master copy + moments m, v
    fp32 = _estimate(capsys, "--params", "70B", "--precision", "fp32")["memory"]["strategies"]["ddp"]
    assert fp32["optimizer"] == pytest.approx(560e9)


def test_zero_paper_7_5b_model_on_64_gpus(capsys):
    """Rajbhandari et al. 2020, figure 1: 120 / 31.4 / 16.6 / 1.9 GB per GPU with Adam (K = 12)."""
    rows = _estimate(capsys, "--params", "7.5B", "--gpus", "64")["memory"]["strategies"]
    got = {name: round(rows[name]["total"] / 1e9, 1) for name in ("ddp", "zero1", "zero2", "zero3", "fsdp")}
    assert got == {"ddp": 120.0, "zero1": 31.4, "zero2": 16.6, "zero3": 1.9, "fsdp": 1.9}


def test_zero_paper_figures_in_the_printed_table(capsys):
    assert main(["estimate", "--params", "7.5B", "--gpus", "64", "--gpu", "a100", "--strategy", "zero2"]) == 0
    out = capsys.readouterr().out
    rows = {line[2:].split()[0]: line for line in out.splitlines()
            if line[2:].split()[:1] and line[2:].split()[0] in memory.STRATEGIES}
    assert rows["ddp"].split()[-2:] == ["120.0", "no"] and rows["zero1"].split()[-2:] == ["31.4", "yes"]
    assert rows["zero2"].startswith("* zero2") and rows["zero3"].split()[-2] == "1.9"
    assert len({len(line) for line in rows.values()}) == 1  # aligned columns
    assert "smallest strategy that fits    zero1" in out


# ---------------------------------------------------------------- hand counts


def test_gpt2_small_shape_has_124m_parameters():
    assert TransformerShape(layers=12, hidden=768, heads=12, seq_len=1024, vocab=50257).params == 124_439_808


S, H, A, T = 2048, 12288, 96, 8
SBH = S * H


@pytest.mark.parametrize("tp, sp, recompute, per_layer", [
    (1, False, "none", SBH * (34 + 5 * A * S / H)),
    (T, False, "none", SBH * (10 + 24 / T + 5 * A * S / (H * T))),
    (T, True, "none", SBH * (34 / T + 5 * A * S / (H * T))),
    (T, False, "selective", SBH * (10 + 24 / T)),
    (T, True, "selective", SBH * 34 / T),
    (1, False, "full", SBH * 2),
])
def test_activations_per_layer_follow_korthikanti_table_2(tp, sp, recompute, per_layer):
    got = activations.layer_bytes(GPT3, 1, tp=tp, sequence_parallel=sp, recompute=recompute)
    assert got == pytest.approx(per_layer)


def test_activations_on_the_first_pipeline_stage_are_l_layers_whatever_p():
    """1F1B: stage 0 holds p micro-batches of L/p layers; only the embedding-dropout mask grows with p."""
    one = activations.layer_bytes(GPT3, 2, tp=8, sequence_parallel=True)
    for pp in (2, 4, 8):
        total = activations.transformer_bytes(GPT3, 2, tp=8, pp=pp, sequence_parallel=True)
        assert total == pytest.approx(96 * one + S * 2 * H * pp / 8)
    full = activations.transformer_bytes(GPT3, 1, recompute="full")
    ends = 4 * SBH + 4 * S * GPT3.vocab + SBH  # norm + projection inputs, fp32 logits, embedding mask
    assert full == pytest.approx(96 * 2 * SBH + activations.layer_bytes(GPT3, 1) + ends)


def test_saved_tensors_of_a_meta_mlp_match_a_hand_count():
    """Linear(4,8) saves its input (3x4), ReLU its output (3x8), which Linear(8,2) also saves (counted once)."""
    with torch.device("meta"):
        mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    assert measure.saved_tensor_bytes(mlp, (4,), 3) == (3 * 4 + 3 * 8) * 4
    assert measure.saved_tensor_bytes(mlp, (4,), 3, element_bytes=2) == (3 * 4 + 3 * 8) * 2


def test_counted_flops_of_a_meta_mlp_match_a_hand_count():
    """Forward 2*(4*8 + 8*2) = 96 per sample; backward: both weight grads (96) and only the
    second layer's input grad (32): the first layer's input needs none."""
    with torch.device("meta"):
        mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    assert measure.counted_per_sample(mlp, (4,)) == 96 + 96 + 32


def test_wall_time_is_flops_over_gpus_times_peak_times_mfu(capsys):
    out = _estimate(capsys, "--params", "1B", "--tokens", "20B", "--gpus", "8", "--gpu", "h100", "--mfu", "0.5")
    expected = 6 * 1e9 * 20e9 / (8 * 989.4e12 * 0.5)
    assert out["compute"]["wall_seconds"] == pytest.approx(expected)
    assert out["compute"]["gpu_hours"] == pytest.approx(expected * 8 / 3600)


def test_registered_model_is_built_on_the_meta_device(capsys):
    out = _estimate(capsys, "--model", "simple_cnn", "--tokens", "50000", "--micro-batch", "4", "--precision", "fp32")
    assert out["model"]["params"] == 2_474_506
    acts = out["memory"]["strategies"]["ddp"]["activations"]
    assert acts > 4 * 64 * 32 * 32 * 4  # at least the first conv's output, fp32, batch 4
    assert out["compute"]["flops_counted"] > 10 * out["compute"]["flops"]  # a conv reuses each weight per pixel


def test_checkpoint_size_write_time_and_young_daly(capsys):
    out = _estimate(capsys, "--params", "7.5B", "--gpus", "1000", "--mtbf-hours", "50000", "--ckpt-bandwidth", "5")
    assert out["checkpoint"]["bytes"] == pytest.approx(7.5e9 * 14)  # bf16 weights + fp32 master, m, v
    assert out["checkpoint"]["write_seconds"] == pytest.approx(7.5e9 * 14 / 5e9)
    rel = out["reliability"]
    assert rel["cluster_mtbf_hours"] == pytest.approx(50.0)
    assert rel["young_daly_seconds"] == pytest.approx(math.sqrt(2 * 21.0 * 50 * 3600))


def test_young_daly_minimises_the_first_order_overhead():
    save, mtbf = 60.0, 7200.0
    best = reliability.young_daly_seconds(save, mtbf)
    assert best == pytest.approx(math.sqrt(2 * 60 * 7200))
    at = [reliability.overhead_fraction(save, best * k, mtbf) for k in (0.5, 1.0, 2.0)]
    assert at[1] < at[0] and at[1] < at[2]


def test_tp_and_pp_split_the_states_before_zero_shards_them(capsys):
    rows = _estimate(capsys, "--params", "8B", "--gpus", "64", "--tp", "4", "--pp", "2")["memory"]["strategies"]
    assert rows["ddp"]["weights"] == pytest.approx(8e9 / 8 * 2)
    assert rows["zero1"]["optimizer"] == pytest.approx(8e9 / 8 * 12 / 8)  # dp = 64 / (4 x 2)


def test_smallest_strategy_that_fits():
    layout = memory.MASTER
    rows = {s: memory.per_rank(7.5e9, s, dp=64, layout=layout) for s in memory.STRATEGIES}
    assert memory.smallest_fit(rows, 80e9) == "zero1"
    assert memory.smallest_fit(rows, 20e9) == "zero2"
    assert memory.smallest_fit(rows, 2e9) == "zero3"
    assert memory.smallest_fit(rows, 1e9) is None


def test_predicted_bytes_per_rank_for_the_sharded_benchmark():
    """What the FSDP/DDP memory benchmark compares against: torch AMP keeps fp32 params (4+4+8)."""
    with torch.device("meta"):
        net = nn.Linear(1000, 1000)
    n = 1000 * 1000 + 1000
    fsdp = memory.predict_rank_bytes(net, "fsdp", 4)
    assert (fsdp.weights, fsdp.grads, fsdp.optimizer) == (n, n, 2 * n)
    assert fsdp.activations is None
    shape = TransformerShape(layers=2, hidden=64, heads=4, seq_len=32, vocab=100)
    ddp = memory.predict_rank_bytes(net, "ddp", 2, shape=shape, micro_batch=8)
    loss_grads = 8 * 32 * 8 * 100  # two fp32 s x b x V gradients at the start of backward
    assert ddp.total == pytest.approx(16 * n + activations.transformer_bytes(shape, 8, dropout=False) + loss_grads)


def test_peak_table_lookup_for_mfu():
    assert hardware.peak_tflops("H100", "bf16") == pytest.approx(989.4)
    assert hardware.peak_tflops("mi300x", "fp8") == pytest.approx(2614.9)
    assert hardware.lookup("A100-SXM").memory_gb == 80
    with pytest.raises(UserError, match="no dense fp8"):
        hardware.peak_tflops("a100", "fp8")
    for acc in hardware.ACCELERATORS.values():  # fp16 = bf16, tf32 = half of bf16 (dense) on NVIDIA
        if acc.tflops["bf16"] is not None:  # V100: fp16 alone (tests/estimate/test_estimate_details.py)
            assert acc.tflops["fp16"] == acc.tflops["bf16"] and acc.tflops["tf32"] < acc.tflops["bf16"]


@pytest.mark.parametrize("text, value", [("7.5B", 7.5e9), ("300b", 300e9), ("1.4T", 1.4e12), ("125M", 125e6),
                                         ("7.5e9", 7.5e9), ("1,000", 1000.0)])
def test_parse_count(text, value):
    assert parse_count(text, "--params") == pytest.approx(value)


# ---------------------------------------------------------------- bad inputs: exit 2, naming the flag


@pytest.mark.parametrize("argv, flag", [
    ([], "--params"),
    (["--params", "7B", "--gpus", "6", "--tp", "4"], "--tp 4 x --pp 1"),
    (["--params", "7B", "--gpus", "8", "--pp", "3"], "--pp 3"),
    (["--params", "7B", "--gpu", "tpu-v5e"], "--gpu 'tpu-v5e'"),  # v100 is in the table now
    (["--params", "lots"], "--params 'lots'"),
    (["--layers", "12", "--hidden", "768"], "missing: --heads --vocab"),  # --seq-len: optional for a count
    (["--layers", "12", "--hidden", "768", "--heads", "5", "--seq-len", "8", "--vocab", "9"], "--heads (5)"),
    (["--params", "7B", "--mfu", "1.5"], "--mfu"),
    (["--params", "7B", "--gpu", "a100", "--precision", "fp8"], "--precision fp8"),
    (["--model", "no_such_model"], "--model"),
])
def test_bad_inputs_exit_2_naming_the_flag(argv, flag, capsys):
    assert main(["estimate", *argv]) == 2
    err = capsys.readouterr().err
    assert flag in err and "Traceback" not in err


# ---------------------------------------------------------------- prediction vs measurement (GPU only)


class _Block(nn.Module):
    """Pre-norm GPT block with SDPA (flash) attention: the layout Korthikanti's selective row models."""

    def __init__(self, h: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc, self.out = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, h))
        return x + self.out(nn.functional.gelu(self.fc(self.ln2(x))))


class _GPT(nn.Module):
    def __init__(self, shape: TransformerShape) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(shape.vocab, shape.hidden), nn.Embedding(shape.seq_len, shape.hidden)
        self.blocks = nn.ModuleList(_Block(shape.hidden, shape.heads) for _ in range(shape.layers))
        self.ln = nn.LayerNorm(shape.hidden)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.ln(x) @ self.tok.weight.t()  # tied output embedding


def _measured_peak(shape: TransformerShape, micro_batch: int) -> tuple[nn.Module, int]:
    net = _GPT(shape).cuda()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4, fused=True)
    idx = torch.randint(0, shape.vocab, (micro_batch, shape.seq_len), device="cuda")
    for _ in range(3):  # the peak of a steady-state step, Adam's moments allocated
        torch.cuda.reset_peak_memory_stats()
        with torch.autocast("cuda", torch.bfloat16):
            logits = net(idx)
        loss = nn.functional.cross_entropy(logits.float().view(-1, shape.vocab), idx.view(-1))
        del logits
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return net, torch.cuda.max_memory_allocated()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="peak memory is measured with CUDA's allocator")
@pytest.mark.parametrize("layers, hidden, heads, micro_batch", [(12, 768, 12, 8), (24, 1024, 16, 4)])
def test_predicted_bytes_agree_with_a_measured_gpu_step_within_15_percent(layers, hidden, heads, micro_batch):
    """One rank, bf16 autocast, fused AdamW, SDPA attention (no stored scores: the selective row)."""
    shape = TransformerShape(layers=layers, hidden=hidden, heads=heads, seq_len=1024, vocab=50257)
    net, peak = _measured_peak(shape, micro_batch)
    pred = memory.predict_rank_bytes(net, "ddp", 1, shape=shape, micro_batch=micro_batch, recompute="selective")
    print(f"\n{layers}x{hidden} b={micro_batch}: measured {peak / 1e9:.2f} GB, predicted {pred.total / 1e9:.2f} GB "
          f"(without gradients {(pred.total - pred.grads) / 1e9:.2f} GB)")
    assert abs(pred.total / peak - 1) < 0.15


def test_a_token_model_from_the_registry_is_measured_with_int64_inputs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--model", "gpt", "--gpus", "1", "--gpu", "h100", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"]["params"] == 842_496  # the default GPT (hpctrain models)
    assert out["memory"]  # activations measured by a meta forward on int64 tokens
