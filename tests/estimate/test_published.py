"""`hpctrain estimate` against published figures it was not built on, and today's architectures.

Every case here is a row of the table in docs/estimate.md ("case, published figure,
hpctrain's, ratio"); the published numbers are the papers' and model cards', the shapes the
papers' own (or the released config.json, in tests/estimate/hf_configs/). Pure Python, no torch.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hpctrain.cli import main
from hpctrain.estimate import activations, flops, hfconfig, reliability
from hpctrain.models.shape import TransformerShape, llama_ffn, stage_layers, stage_params

CONFIGS = Path(__file__).parent / "hf_configs"
DOCS = Path(__file__).parents[2] / "docs" / "estimate.md"


def _estimate(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    assert main(["estimate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _config(name: str) -> list[str]:
    return ["--hf-config", str(CONFIGS / f"{name}.json")]


def _shape(layers: int, hidden: int, heads: int, vocab: int, seq: int = 2048) -> list[str]:
    return ["--layers", str(layers), "--hidden", str(hidden), "--heads", str(heads), "--seq-len", str(seq),
            "--vocab", str(vocab)]


# Llama 3 405B as Dubey et al. 2024 table 3 gives it (vocabulary: the released 128,256)
LLAMA3_405B = [*_shape(126, 16384, 128, 128256, 8192), "--kv-heads", "8", "--ffn-hidden", "53248", "--mlp", "swiglu",
               "--untied-embeddings", "--positions", "rotary", "--norm", "rmsnorm", "--bias", "none", "--no-dropout"]
GPT3 = _shape(96, 12288, 96, 51200)  # Narayanan et al. 2021 pad GPT-3's vocabulary to 51,200


def _params(out: dict[str, Any]) -> float:
    return out["model"]["params"]


def _active(out: dict[str, Any]) -> float:
    return out["model"]["active_params"]


def _flops(out: dict[str, Any]) -> float:
    return out["compute"]["flops"]


def _days(out: dict[str, Any]) -> float:
    return out["compute"]["wall_days"]


def _zero(out: dict[str, Any]) -> float:
    return out["memory"]["strategies"]["zero1"]["total"]


def _cluster_mtbf(out: dict[str, Any]) -> float:
    return out["reliability"]["cluster_mtbf_hours"]


# case id (as in docs/estimate.md), argv, what to read, published figure, largest |ratio - 1|
CASES: list[tuple[str, list[str], Callable[[dict[str, Any]], float], float, float]] = [
    ("gpt2-params", _config("gpt2"), _params, 124e6, 0.01),
    ("llama-2-7b-params", _config("llama-2-7b"), _params, 6.74e9, 0.01),
    ("llama-3-8b-params", _config("llama-3-8b"), _params, 8.03e9, 0.01),
    ("mistral-7b-params", _config("mistral-7b"), _params, 7.24e9, 0.01),
    ("mistral-nemo-12b-params", _config("mistral-nemo-12b"), _params, 12.25e9, 0.01),  # head_dim 128 < 5120 / 32
    ("mixtral-8x7b-total-params", _config("mixtral-8x7b"), _params, 46.7e9, 0.01),
    ("mixtral-8x7b-active-params", _config("mixtral-8x7b"), _active, 12.9e9, 0.01),
    ("pythia-1.4b-params", _config("pythia-1.4b"), _params, 1_414_647_808, 1e-9),
    ("bloom-176b-params", [*_shape(70, 14336, 112, 250880), "--positions", "alibi"], _params, 176_247_271_424, 1e-6),
    ("megatron-145.6b-params", _shape(80, 12288, 96, 51200), _params, 145.6e9, 0.001),
    ("megatron-1008b-params", _shape(128, 25600, 160, 51200), _params, 1008.0e9, 0.001),
    ("llama-3-405b-params", LLAMA3_405B, _params, 405e9, 0.01),
    ("gpt-3-175b-flops", [*_shape(96, 12288, 96, 50257), "--tokens", "300B"], _flops, 3.14e23, 0.01),
    ("chinchilla-70b-flops", ["--params", "70B", "--tokens", "1.4T"], _flops, 5.76e23, 0.025),
    ("llama-3-405b-flops", [*LLAMA3_405B, "--tokens", "15.6T"], _flops, 3.8e25, 0.01),
    ("megatron-gpt-3-175b-days", [*GPT3, "--tokens", "300B", "--gpus", "1024", "--gpu", "a100", "--tp", "8",
                                  "--pp", "8", "--activation-checkpointing", "full", "--achieved-tflops", "140"],
     _days, 34, 0.03),
    ("megatron-1t-days", [*_shape(128, 25600, 160, 51200), "--tokens", "450B", "--gpus", "3072", "--gpu", "a100",
                          "--tp", "8", "--pp", "64", "--activation-checkpointing", "full", "--achieved-tflops", "163"],
     _days, 84, 0.03),
    ("zero-7.5b-zero1-memory", ["--params", "7.5B", "--gpus", "64"], _zero, 31.4e9, 0.005),
    ("llama-3-405b-mtbf", ["--params", "405B", "--gpus", "16384", "--failure-preset", "llama3-405b"],
     _cluster_mtbf, 54 * 24 / 419, 1e-9),
    ("kokolis-1024-gpu-mttf", ["--params", "7B", "--gpus", "1024"], _cluster_mtbf, 7.9, 1e-9),
]


@pytest.mark.parametrize("argv, read, published, tolerance", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_published_figure(argv, read, published, tolerance, capsys):
    ratio = read(_estimate(capsys, *argv)) / published
    assert abs(ratio - 1) <= tolerance, f"ratio {ratio:.4f}"


def test_every_case_is_a_row_of_the_docs_table():
    table = DOCS.read_text()
    missing = [case for case, *_ in CASES if f"`{case}`" not in table]
    assert not missing, f"docs/estimate.md lacks rows for {missing}"


# ---------------------------------------------------------------- today's architectures, counted by hand


def test_hf_configs_give_the_exact_hand_counts():
    """Per layer: attention 2h^2 + 2h·kv_dim (+ biases), MLP 3·h·f (SwiGLU) x experts, norms;
    plus untied input and output embeddings and the final norm."""
    def llama(h: int, kv: int, f: int, layers: int, vocab: int, experts: int = 1, qkv_bias: int = 0) -> int:
        router = h * experts if experts > 1 else 0
        return layers * (2 * h * h + 2 * h * kv + qkv_bias + experts * 3 * h * f + router + 2 * h) + 2 * vocab * h + h

    expected = {"llama-2-7b": llama(4096, 4096, 11008, 32, 32000), "llama-3-8b": llama(4096, 1024, 14336, 32, 128256),
                "mistral-7b": llama(4096, 1024, 14336, 32, 32000),
                "mixtral-8x7b": llama(4096, 1024, 14336, 32, 32000, experts=8),
                "qwen2-7b": llama(3584, 512, 18944, 28, 152064, qkv_bias=3584 + 2 * 512),
                "gpt2": 124_439_808, "pythia-1.4b": 1_414_647_808}
    for name, count in expected.items():
        fields, _ = hfconfig.read(str(CONFIGS / f"{name}.json"))
        assert TransformerShape(**fields).params == count, name
    assert expected["llama-2-7b"] == 6_738_415_616 and expected["mixtral-8x7b"] == 46_702_792_704


def test_llama_swiglu_width_is_8h_over_3_rounded_up_to_256():
    assert llama_ffn(4096) == 11008  # Llama 2 7B's intermediate_size
    shape = TransformerShape(layers=1, hidden=4096, heads=32, seq_len=8, vocab=8, mlp="swiglu", bias="none")
    assert shape.expert_params == 3 * 4096 * 11008


def test_mixture_of_experts_flops_come_from_the_active_parameters(capsys):
    out = _estimate(capsys, *_config("mixtral-8x7b"), "--seq-len", "4096", "--tokens", "1B")
    assert out["compute"]["flops"] == pytest.approx(6 * 12_879_925_248 * 1e9)
    attention = 12 * 32 * 4096 * 4096 * 1e9
    lookup = 32000 * 4096  # the untied input embedding: read, not multiplied
    assert out["compute"]["model_flops"] == pytest.approx(6 * (12_879_925_248 - lookup) * 1e9 + attention)


def test_expert_parallelism_splits_the_experts_and_shards_them_over_dp_over_ep(capsys):
    args = [*_config("mixtral-8x7b"), "--seq-len", "4096", "--gpus", "64"]
    plain = _estimate(capsys, *args)["memory"]["strategies"]
    split = _estimate(capsys, *args, "--ep", "8")["memory"]["strategies"]
    shape = TransformerShape(**hfconfig.read(str(CONFIGS / "mixtral-8x7b.json"))[0])
    experts, dense = shape.expert_total, shape.params - shape.expert_total
    assert plain["ddp"]["weights"] == pytest.approx(2 * shape.params)
    assert split["ddp"]["weights"] == pytest.approx(2 * (dense + experts / 8))
    # ZeRO-1: the experts' optimizer state over the 64 / 8 ranks holding the same experts
    assert split["zero1"]["optimizer"] == pytest.approx(12 * (dense / 64 + experts / 8 / 8))


def test_grouped_query_attention_shrinks_k_and_v_activations():
    mha = TransformerShape(layers=1, hidden=4096, heads=32, seq_len=1024, vocab=8, dropout=False)
    gqa = TransformerShape(layers=1, hidden=4096, heads=32, seq_len=1024, vocab=8, dropout=False, kv_heads=8)
    saved = (activations.layer_bytes(mha, 1, recompute="selective")
             - activations.layer_bytes(gqa, 1, recompute="selective"))
    assert saved == 2 * 1024 * 2 * (4096 - 1024)  # K and V, 2 bytes each, 3/4 narrower


def test_swiglu_moe_activations_count_four_tensors_of_the_mlp_width_per_routed_expert():
    shape = TransformerShape(layers=1, hidden=64, heads=4, seq_len=16, vocab=8, mlp="swiglu", ffn_hidden=96,
                             experts=8, top_k=2, dropout=False)
    sb = 16 * 3
    expected = 4 * 2 * sb * 64 + 2 * sb * (2 * 64 + 2 * 64) + 2 * sb * 96 * 4 * 2
    assert activations.layer_bytes(shape, 3, recompute="selective") == expected


# ---------------------------------------------------------------- uneven pipeline stages


def test_uneven_stages_put_the_remainder_on_the_middle_stages():
    assert stage_layers(126, 16) == [7] + [8] * 14 + [7]  # Llama 3 405B (Dubey et al. 2024, 3.3.2)
    assert stage_layers(70, 12) == [5] + [6] * 10 + [5]  # BLOOM-176B's 70 layers on 12 stages
    assert stage_layers(5, 2) == [2, 3] and stage_layers(8, 4) == [2, 2, 2, 2]
    shape = TransformerShape(layers=5, hidden=8, heads=2, seq_len=4, vocab=10)
    held = stage_params(shape, 2)
    assert held == [2 * shape.layer_params + shape.embedding_params,
                    3 * shape.layer_params + shape.head_params + 10 * 8]  # tied: a copy of the embedding at the end
    assert sum(held) == shape.params + 10 * 8


def test_memory_per_gpu_is_the_largest_stage(capsys):
    out = _estimate(capsys, *LLAMA3_405B, "--gpus", "16384", "--tp", "8", "--pp", "16", "--sequence-parallel",
                    "--activation-checkpointing", "full", "--strategy", "zero1")
    mem = out["memory"]
    assert mem["pipeline"]["stage_layers"] == [7] + [8] * 14 + [7]
    # the table is the declaration's (issue 39): its zero1 row is the declared line, stage and total; the
    # last stage (7 layers, the head and the loss's fp32 buffers) is the busiest, not a middle one of 8 layers
    declared = mem["declared"]
    assert mem["pipeline"]["largest_stage"] == mem["strategies"]["zero1"]["stage"] == declared["stage"] == 15
    assert declared["stages"].index(max(declared["stages"])) == 15
    assert mem["strategies"]["zero1"]["total"] == pytest.approx(declared["total"])
    assert main(["estimate", *LLAMA3_405B, "--gpus", "16384", "--tp", "8", "--pp", "16"]) == 0
    assert "memory per GPU is the largest stage's (stage 1, 8 layers)" in capsys.readouterr().out  # ddp: 1F1B's first


def test_bloom_on_12_stages_is_accepted(capsys):
    out = _estimate(capsys, *_shape(70, 14336, 112, 250880), "--positions", "alibi", "--gpus", "384", "--gpu",
                    "a100", "--tp", "4", "--pp", "12", "--activation-checkpointing", "full", "--micro-batch", "2")
    assert out["memory"]["pipeline"]["stage_layers"] == [5] + [6] * 10 + [5]
    assert out["memory"]["smallest_fit"] is not None


# ---------------------------------------------------------------- time, MFU and HFU


def test_full_recompute_makes_narayanans_8nd_and_mfu_three_quarters_of_hfu(capsys):
    out = _estimate(capsys, *GPT3, "--tokens", "300B", "--gpus", "1024", "--gpu", "a100",
                    "--activation-checkpointing", "full", "--achieved-tflops", "140")["compute"]
    shape = TransformerShape(layers=96, hidden=12288, heads=96, seq_len=2048, vocab=51200)
    attention = flops.attention_flops(shape, 300e9)
    multiplied = shape.params - 2048 * 12288  # the learned position table is read, not multiplied
    assert out["model_flops"] == pytest.approx(6 * multiplied * 300e9 + attention)
    blocks = 96 * shape.layer_params
    assert out["hardware_flops"] == pytest.approx(out["model_flops"] + 2 * blocks * 300e9 + attention / 3)
    assert out["hfu"] == pytest.approx(140 / 312)
    assert out["mfu"] == pytest.approx(out["hfu"] * out["model_flops"] / out["hardware_flops"])
    assert out["wall_seconds"] == pytest.approx(out["hardware_flops"] / (1024 * 140e12))
    assert out["tokens_per_second"] == pytest.approx(300e9 / out["wall_seconds"])


def test_mfu_counts_attention_and_selective_recompute_only_costs_hardware_flops(capsys):
    args = [*_shape(2, 64, 4, 100, 128), "--tokens", "1M", "--mfu", "0.5"]
    none = _estimate(capsys, *args)["compute"]
    sel = _estimate(capsys, *args, "--activation-checkpointing", "selective")["compute"]
    assert none["hfu"] == none["mfu"] == 0.5 and none["wall_seconds"] == sel["wall_seconds"]
    assert sel["hardware_flops"] - sel["model_flops"] == pytest.approx(4 * 2 * 64 * 128 * 1e6)


# ---------------------------------------------------------------- failure presets


def test_failure_presets_derive_per_gpu_mtbf_from_the_published_logs():
    got = {name: p.gpu_mtbf_hours for name, p in reliability.FAILURE_PRESETS.items()}
    assert got == pytest.approx({"kokolis-2024": 7.9 * 1024, "llama3-405b": 16384 * 54 * 24 / 419,
                                 "opt-175b": 992 * 60 * 24 / 100, "bloom-176b": 384 * 7 * 24 / 1.5})
    assert reliability.DEFAULT_GPU_MTBF_HOURS == pytest.approx(8089.6)  # Kokolis: a shared research cluster


def test_failure_preset_and_raw_mtbf(capsys):
    rel = _estimate(capsys, "--params", "7B", "--gpus", "992", "--failure-preset", "opt-175b")["reliability"]
    assert rel["cluster_mtbf_hours"] == pytest.approx(14.4)
    assert rel["mtbf_source"].startswith("opt-175b (Zhang et al. 2022")
    rel = _estimate(capsys, "--params", "7B", "--gpus", "10", "--mtbf-hours", "100")["reliability"]
    assert rel["cluster_mtbf_hours"] == 10 and rel["mtbf_source"] == "--mtbf-hours"


# ---------------------------------------------------------------- bad input: exit 2 naming file, key, flag


def _write(tmp_path: Path, config: dict[str, Any] | str) -> str:
    path = tmp_path / "config.json"
    path.write_text(config if isinstance(config, str) else json.dumps(config))
    return str(path)


@pytest.mark.parametrize("edit, message", [
    ({"model_type": "t5"}, "model_type 't5' is not supported; supported: llama, mistral"),
    ({"model_type": None}, "key 'model_type' missing"),
    ({"intermediate_size": None}, "key 'intermediate_size' missing (model_type 'llama' needs it)"),
    ({"num_attention_heads": "32"}, "key 'num_attention_heads' is '32', expected a positive integer"),
    ({"num_key_value_heads": 5}, "--kv-heads (5) must divide --heads (32)"),
])
def test_bad_hf_configs_exit_2_naming_the_file_and_key(edit, message, tmp_path, capsys):
    config = json.loads((CONFIGS / "llama-3-8b.json").read_text())
    config.update(edit)
    path = _write(tmp_path, {k: v for k, v in config.items() if v is not None})
    assert main(["estimate", "--hf-config", path]) == 2
    err = capsys.readouterr().err
    assert message in err and path in err and "Traceback" not in err


@pytest.mark.parametrize("argv, message", [
    (["--hf-config", "/no/such/config.json"], "--hf-config /no/such/config.json: no such file"),
    (["--hf-config", "BROKEN"], "not a readable JSON file"),
    (["--params", "7B", "--gpus", "8", "--ep", "2"], "--ep 2 needs a mixture of experts"),
    ([*_config("mixtral-8x7b"), "--gpus", "8", "--ep", "3"], "--ep 3 must divide the data-parallel degree 8"),
    ([*_config("mixtral-8x7b"), "--gpus", "48", "--ep", "3"], "--ep 3 must divide --experts 8"),
    ([*_shape(4, 64, 4, 100), "--pp", "8", "--gpus", "8"], "--pp 8 exceeds the 4 layers"),
    ([*_shape(4, 64, 4, 100), "--experts", "2", "--top-k", "3"], "--top-k (3) cannot exceed --experts (2)"),
    (["--params", "7B", "--failure-preset", "titan"], "--failure-preset 'titan' is not one of kokolis-2024"),
    (["--params", "7B", "--failure-preset", "opt-175b", "--mtbf-hours", "5"], "not both"),
    (["--params", "7B", "--tokens", "1B", "--mfu", "0.4", "--hfu", "0.5"], "got --mfu and --hfu"),
    (["--params", "7B", "--tokens", "1B", "--gpu", "a100", "--achieved-tflops", "400"],
     "--achieved-tflops 400 exceeds the dense peak of a100 at bf16, 312 TFLOP/s"),
    (["--params", "7B", "--tokens", "1B", "--mfu", "0.9", "--activation-checkpointing", "full"],
     "120% hardware FLOPs utilisation"),
    (["--kv-heads", "8"], "missing: --layers --hidden --heads --vocab"),
])
def test_bad_inputs_exit_2(argv, message, tmp_path, capsys):
    argv = [_write(tmp_path, "{not json") if a == "BROKEN" else a for a in argv]
    assert main(["estimate", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_flags_override_the_hf_config(capsys):
    out = _estimate(capsys, *_config("llama-3-8b"), "--seq-len", "4096", "--kv-heads", "32")
    assert out["model"]["shape"]["seq_len"] == 4096
    assert out["model"]["params"] == pytest.approx(8_030_261_248 + 32 * 2 * 4096 * (4096 - 1024))


def test_estimate_from_an_hf_config_imports_no_torch(tmp_path):
    from tests.test_imports import chain_to, imports_of_command

    tree = imports_of_command(["estimate", *_config("mixtral-8x7b"), "--tokens", "1T", "--gpus", "64", "--ep", "8"],
                              cwd=tmp_path)
    assert chain_to(tree, "torch") is None and chain_to(tree, "numpy") is None


def test_the_text_report_shows_mfu_hfu_tokens_per_second_and_active_parameters(capsys):
    argv = [*_config("mixtral-8x7b"), "--seq-len", "4096", "--tokens", "1T", "--gpus", "512", "--tp", "2", "--pp", "4",
            "--ep", "8", "--activation-checkpointing", "full"]
    assert main(["estimate", *argv]) == 0
    out = capsys.readouterr().out
    for line in ("12.9B active per token (12,879,925,248): a mixture of experts", "(ep 8 within dp)",
                 "MFU / HFU                      40.0% / 53.2% (mfu given", "tokens/s                       2,443,211",
                 "hardware FLOPs (+ recompute)", "8 x4; memory per GPU is the largest stage's (stage 3, 8 layers)"):
        assert line in out
