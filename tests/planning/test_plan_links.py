"""Machines as they are (issue 39 point 3): each GPU's link inside a node and each node's network
come from hpctrain/planning/links.py, the cost model uses them, and tensor parallelism is not put
over PCIe unless nothing else fits."""

from __future__ import annotations

import pytest

from hpctrain.cli import main
from hpctrain.config import load_config
from hpctrain.core.env import ClusterEnv
from hpctrain.planning.auto import choose
from hpctrain.planning.links import links_for

AUTO = ["parallel.strategy=auto", "precision=bf16", "optim.name=adamw"]
LLAMA2_13B = ["model.name=llama", "model.n_layers=40", "model.hidden=5120", "model.heads=40", "model.kv_heads=40",
              "model.ffn_hidden=13824", "model.vocab=32000", "model.tie_weights=false", "model.seq_len=4096"]
LLAMA3_70B = ["model.name=llama", "model.n_layers=80", "model.hidden=8192", "model.heads=64", "model.kv_heads=8",
              "model.ffn_hidden=28672", "model.vocab=128256", "model.tie_weights=false", "model.seq_len=8192"]


def _choose(model: list[str], gpu: str, gpus: int, batch: int, network: float | None = None):
    cfg = load_config(None, [*model, *AUTO, f"parallel.target_gpu={gpu}", f"data.global_batch_size={batch}"])
    return choose(cfg, ClusterEnv(world_size=gpus, local_world_size=8, num_nodes=gpus // 8), network_gbps=network)


def test_each_gpu_has_its_link_and_network():
    h100, l40s, pcie = links_for("h100-sxm"), links_for("l40s"), links_for("h100-pcie")
    assert (h100.intra, h100.inter, h100.pcie) == (450e9, 50e9, False)  # NVLink 4: 900 GB/s both ways
    assert (l40s.intra, l40s.inter, l40s.pcie) == (32e9, 12.5e9, True)
    assert pcie.pcie and pcie.intra == 64e9
    assert links_for("b200").intra == 900e9 and links_for("a100").intra == 300e9
    assert links_for("h100-sxm", 200).inter == 25e9


def test_13b_on_two_l40s_nodes_keeps_tensor_parallel_off_pcie():
    """It planned fsdp dp4 x tp2 x pp2 with NVLink's 150 GB/s assumed for every GPU."""
    choice = _choose(LLAMA2_13B, "l40s", 16, 64)
    assert choice.machine.pcie and choice.machine.intra == 32e9
    assert choice.chosen.tp == 1 and choice.chosen.fits
    assert any(c.fits and c.tp > 1 for c in choice.candidates)  # tp fits, and is not chosen


def test_70b_on_64_h100_sxm_ranks_torchtitans_layout_by_the_cost_model():
    """torchtitan runs Llama 3.1 70B as FSDP x TP8 with full recompute (docs/performance.md, table 4);
    on 64 H100 SXM at 8,192 tokens that layout fits 80 GB only with full recompute, so the cost model
    prefers a pipeline that fits with selective recompute (docs/estimate.md says so)."""
    choice = _choose(LLAMA3_70B, "h100-sxm", 64, 64)
    titan = [c for c in choice.candidates if (c.strategy, c.dp, c.tp, c.pp) == ("fsdp", 8, 8, 1)]
    assert titan and all(c.checkpointing == "block" for c in titan if c.fits)
    best_titan = max((c for c in titan if c.fits), key=lambda c: c.samples_per_s)
    assert choice.chosen.pp > 1 and choice.chosen.checkpointing == "selective"
    assert 0.85 < best_titan.samples_per_s / choice.chosen.samples_per_s < 1


def test_the_network_flag_reaches_the_cost_model_and_is_refused_when_not_a_rate(capsys):
    slow, fast = _choose(LLAMA2_13B, "h100-sxm", 16, 64, 25), _choose(LLAMA2_13B, "h100-sxm", 16, 64, 3200)
    assert slow.machine.inter == 25e9 / 8 and fast.machine.inter == 400e9
    layout = next(c for c in slow.candidates if c.label == fast.chosen.label and c.checkpointing ==
                  fast.chosen.checkpointing)
    assert layout.seconds > fast.chosen.seconds  # the same plan costs more on the slower network
    assert main(["plan", "--gpu", "l40s", "--gpus-per-node", "8", "-n", "16", "--network-gbps", "nan",
                 *LLAMA2_13B, *AUTO]) == 2
    assert "--network-gbps is NaN" in capsys.readouterr().err
    assert main(["plan", "--gpu", "l40s", "--gpus-per-node", "8", "-n", "16", *LLAMA2_13B, *AUTO,
                 "data.global_batch_size=64"]) == 0
    assert "links: PCIe 4.0 x16 (32 GB/s each way) in a node, 100 Gb/s per GPU" in capsys.readouterr().out


@pytest.mark.parametrize("gpu", ["h100-nvl", "x999"])
def test_a_part_without_nvlink_or_unknown_has_links(gpu):
    assert links_for(gpu).intra > 0 and links_for(gpu).inter > 0
