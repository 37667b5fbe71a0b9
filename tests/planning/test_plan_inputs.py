"""`hpctrain plan`'s inputs and what it says (issue 42 point 3, issue 39 points 4 and 5): sizes
beyond physical sense are refused at once in one line; a language model's plan without a
precision or an optimizer takes bf16 + AdamW and says so; fp8 is refused where the GPU has none;
offload plans print their host memory; --json always prints one object."""

from __future__ import annotations

import json
import time

import pytest

from hpctrain.cli import main

LLAMA3_8B = ["model.name=llama", "model.n_layers=32", "model.hidden=4096", "model.heads=32", "model.kv_heads=8",
             "model.ffn_hidden=14336", "model.vocab=128256", "model.tie_weights=false", "model.seq_len=8192"]
LLAMA3_70B = ["model.name=llama", "model.n_layers=80", "model.hidden=8192", "model.heads=64", "model.kv_heads=8",
              "model.ffn_hidden=28672", "model.vocab=128256", "model.tie_weights=false", "model.seq_len=4096"]
DEEPSEEK_V3 = ["model.name=llama", "model.n_layers=61", "model.hidden=7168", "model.heads=128", "model.kv_heads=128",
               "model.ffn_hidden=2048", "model.vocab=129280", "model.seq_len=4096", "model.tie_weights=false",
               "model.experts=256", "model.top_k=8", "model.shared_expert=true", "precision=bf16", "optim.name=adamw"]


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = main(["plan", *argv])
    except SystemExit as stop:
        code = int(stop.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def _refused(capsys, *argv: str) -> str:
    code, out, err = _run(capsys, *argv)
    assert (code, out) == (2, ""), (code, out, err)
    assert err.startswith("hpctrain plan: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert not err.startswith("hpctrain plan: error: hpctrain plan"), err  # the prefix once
    return err


@pytest.mark.parametrize("argv, message", [
    (["-n", "1000000000", "--nodes", "1000000000"],
     "1,000,000,000,000,000,000 GPUs is more than any machine has (at most 1,048,576)"),
    (["--gpu", "h100", "-n", "8", "data.batch_size=100000000000"],
     "a global batch of 800,000,000,000 samples is beyond any real job (at most 2^32"),
    (["--gpu", "h100", "-n", "8", "model.name=llama", "model.n_layers=1000000000", "model.hidden=1000000000"],
     "model.n_layers 1,000,000,000 is beyond any real model (at most 16,384)"),
    (["--gpu", "h100", "-n", "8", *LLAMA3_8B, "data.global_batch_size=1000000000"],
     "x 8,192 elements per sample is beyond any real job (at most 2^40"),
    (["--gpu", "h100", "-n", "8", "--gpu-memory-gb", "nan", "model.name=gpt"], "--gpu-memory-gb is NaN, not a number"),
    (["--gpu", "h100", "-n", "8", "model.name=gpt", "parallel.memory_budget_gb=inf"],
     "parallel.memory_budget_gb=inf must be > 0 and finite"),
    (["--gpu", "h100", "--gpus-per-node", "0", "-n", "8"], "--gpus-per-node must be a positive integer, got 0"),
    (["--gpu", "h100", "--gpus-per-node", "3", "-n", "8"],
     "-n 8 GPUs must be a multiple of --gpus-per-node 3; hint: -n 6"),
    (["-n", "-3"], "-n must be a positive integer, got -3"),
    (["--gpu", "a100", "-n", "8", *LLAMA3_8B, "precision=fp8"],
     "precision=fp8: A100-SXM4-80GB has no fp8 matmuls (it has: fp32, tf32, bf16, fp16); hint: precision=bf16"),
])
def test_bad_inputs_exit_2_in_one_line_at_once(argv, message, capsys):
    start = time.monotonic()
    assert message in _refused(capsys, *argv)
    assert time.monotonic() - start < 1.5  # refused before any search (or any torch import)


def test_an_unknown_model_name_is_named_with_the_known_ones(capsys):
    err = _refused(capsys, "--gpu", "h100", "-n", "8", "model.name=lama")
    assert "model.name='lama' is not a registered model; choose one of: mnist_cnn" in err
    assert err.rstrip().endswith("hint: model.name=llama")


def test_a_pipeline_batch_rule_is_said_in_one_short_line(capsys):
    """DeepSeek-V3's 15,360 sequences on 2,048 GPUs: one line under 1,000 characters, each rule once
    (a multiple of pp), and a batch that works; not 33,697 characters of every layout."""
    err = _refused(capsys, "--gpu", "h800", "--gpus-per-node", "8", "-n", "2048", *DEEPSEEK_V3,
                   "data.global_batch_size=15360")
    assert len(err) < 1000, len(err)
    assert "are not a multiple of parallel.pp=2" in err and "more layouts alike" in err
    assert err.rstrip().endswith("hint: a global batch that is a multiple of the 2048 ranks, e.g. "
                                 "data.global_batch_size=16384")


def _plan_json(capsys, *argv: str) -> dict:
    code, out, err = _run(capsys, "--json", *argv)
    assert code == 0, err
    return json.loads(out)


def test_a_language_model_without_precision_or_optimizer_plans_as_bf16_adamw_and_says_so(capsys):
    machine = ["--gpu", "h100-sxm", "-n", "8", *LLAMA3_8B, "data.global_batch_size=16"]
    assumed = _plan_json(capsys, *machine)
    given = _plan_json(capsys, *machine, "precision=bf16", "optim.name=adamw")
    assert assumed["assumed"] == ["precision=bf16", "optim.name=adamw"] and given["assumed"] == []
    assert assumed["chosen"] == given["chosen"] + ["precision=bf16", "optim.name=adamw"]
    assert assumed["label"] == given["label"] == "fsdp dp8"
    assert assumed["assumptions"]["precision"] == "bf16" and assumed["assumptions"]["optimizer"] == "adamw"
    fp32 = _plan_json(capsys, *machine, "precision=fp32")  # given, even as the default value: kept
    assert fp32["assumed"] == ["optim.name=adamw"] and fp32["assumptions"]["precision"] == "fp32"
    code, out, _ = _run(capsys, *machine)
    lines = out.splitlines()
    assert code == 0 and lines[1].startswith("  assumes: precision=bf16 (not given: a language model's default), "
                                             "optim.name=adamw (not given: a language model's default) (2 fp32 "
                                             "states per parameter)")
    assert lines[-1].endswith("precision=bf16 optim.name=adamw")


def test_an_offload_plan_prints_the_host_memory_per_node(capsys):
    """Llama 3 70B on 8 A100-40GB fits only offloaded: 16 bytes per parameter of AdamW in bf16 over 8 ranks
    on the host (141 GB a rank, 1,130 GB the node)."""
    machine = ["--gpu", "a100-40gb", "-n", "8", *LLAMA3_70B, "data.global_batch_size=8"]
    plan = _plan_json(capsys, *machine)
    assert "parallel.cpu_offload=true" in plan["chosen"]
    per_rank = plan["host_bytes_per_rank"]
    assert plan["host_bytes_per_node"] == 8 * per_rank and 140e9 < per_rank < 142e9
    code, out, _ = _run(capsys, *machine)
    assert code == 0 and "host memory (cpu offload): 141 GB per rank, 1,130 GB per node of 8 ranks" in out


def test_json_always_prints_one_object(capsys):
    code, out, err = _run(capsys, "--json", "--gpu", "a100-40gb", "-n", "8", *LLAMA3_70B,
                          "data.global_batch_size=8", "--gpu-memory-gb", "1")
    assert code == 2 and err.startswith("hpctrain plan: error: parallel.strategy=auto: no plan fits")
    none = json.loads(out)
    assert none["fits"] is False and none["exit_code"] == 2 and none["smallest_plan"] == "fsdp+offload dp8"
    assert none["smallest_need_bytes"] == sum(none["smallest_memory_bytes"].values()) > 1e9
    code, out, _ = _run(capsys, "--json", "--gpu", "h100", "-n", "8", "--gpu-memory-gb", "nan")
    assert code == 2 and json.loads(out) == {"fits": False, "exit_code": 2,
                                             "error": "--gpu-memory-gb is NaN, not a number; give a positive number"}
