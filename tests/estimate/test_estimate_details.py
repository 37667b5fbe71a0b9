"""The estimator's details a user trips on: head_dim, the sequence length (shown,
warned about, optional for a parameter count), Megatron's fp32 gradients, more GPUs and flags over
the table, a reader that closes the pipe, --json with every input and assumption, numbers for people.
In-process calls, but for the one subprocess the pipe needs."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hpctrain.cli import EXIT_PIPE, main
from hpctrain.core.errors import UserError
from hpctrain.estimate import flops
from hpctrain.estimate.render import count, sig3
from hpctrain.models.shape import TransformerShape
from hpctrain.telemetry.accelerators import lookup

CONFIGS = Path(__file__).parent / "hf_configs"
NEMO = str(CONFIGS / "mistral-nemo-12b.json")
# Llama 2 7B as flags, rotary positions: its parameters do not depend on the sequence length
LLAMA2_7B = ["--layers", "32", "--hidden", "4096", "--heads", "32", "--vocab", "32000", "--mlp", "swiglu",
             "--positions", "rotary", "--norm", "rmsnorm", "--bias", "none", "--untied-embeddings", "--no-dropout"]


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[dict[str, Any], str]:
    assert main(["estimate", *argv, "--json"]) == 0
    captured = capsys.readouterr()
    return json.loads(captured.out), captured.err


def _text(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[str, str]:
    assert main(["estimate", *argv]) == 0
    captured = capsys.readouterr()
    return captured.out, captured.err


def test_head_dim_narrower_than_hidden_over_heads_counts_mistral_nemo_within_1_percent(capsys):
    out, _ = _json(capsys, "--hf-config", NEMO, "--seq-len", "4096")
    # 40 x (Q and O 5120x4096, K and V 5120x1024, SwiGLU 3x5120x14336, 2 norms) + 2 x 131072x5120 + 5120
    assert out["model"]["params"] == 12_247_782_400
    assert abs(out["model"]["params"] / 12.25e9 - 1) < 0.01  # published 12.25B (ignoring head_dim: 12.77B)
    assert out["model"]["shape"]["head_dim"] == 128
    nemo_flags = [*LLAMA2_7B, "--vocab", "131072", "--layers", "40", "--hidden", "5120", "--kv-heads", "8",
                  "--ffn-hidden", "14336", "--head-dim", "128"]  # later flags win over LLAMA2_7B's
    flag_shape, _ = _json(capsys, *nemo_flags)
    assert flag_shape["model"]["params"] == 12_247_782_400  # --head-dim: the same count from flags
    shape = TransformerShape(**{**out["model"]["shape"]})
    assert flops.attention_flops(shape, 1.0) == 12.0 * 40 * (32 * 128) * 4096  # heads x head_dim, not hidden


def test_the_sequence_length_is_in_the_header_and_a_long_default_warns(capsys):
    text, err = _text(capsys, "--hf-config", NEMO, "--tokens", "1T")
    assert f"seq:   128,000 tokens per sample, from max_position_embeddings in {NEMO}" in text
    assert err.count("warning:") == 1 and "128,000" in err and "max_position_embeddings" in err
    assert "--seq-len 8192" in err  # says how to set it
    out, err = _json(capsys, "--hf-config", NEMO)
    assert out["model"]["seq_len"] == 128_000 and len(out["warnings"]) == 1 and "warning:" in err
    text, err = _text(capsys, "--hf-config", NEMO, "--seq-len", "4096")
    assert "seq:   4,096 tokens per sample, from --seq-len" in text and err == ""
    text, err = _text(capsys, "--hf-config", str(CONFIGS / "llama-3-8b.json"))  # 8,192: the default is not warned
    assert "seq:   8,192 tokens per sample, from max_position_embeddings" in text and err == ""


def test_megatron_layout_keeps_fp32_main_grads_18_bytes_per_parameter(capsys):
    out, _ = _json(capsys, "--params", "7.5B", "--gpus", "64", "--amp-layout", "megatron")
    rows = out["memory"]["strategies"]
    assert out["memory"]["bytes_per_param"] == 18
    assert rows["ddp"]["grads"] == pytest.approx(7.5e9 * 4) and rows["ddp"]["total"] == pytest.approx(7.5e9 * 18)
    assert rows["zero1"]["total"] == pytest.approx(7.5e9 * (6 + 12 / 64))  # Megatron's distributed optimizer
    master, _ = _json(capsys, "--params", "7.5B", "--gpus", "64")  # the default "master" keeps its numbers
    assert master["memory"]["strategies"]["ddp"]["total"] == pytest.approx(7.5e9 * 16)


@pytest.mark.parametrize("name, gb, precision, tflops", [
    ("a100-40gb", 40, "bf16", 312), ("v100", 32, "fp16", 125), ("h800", 80, "bf16", 989.4),
    ("l40s", 48, "bf16", 362.05), ("h100-nvl", 94, "bf16", 835.5), ("h100-96gb", 94, "fp8", 1670.5),
    ("b200", 180, "bf16", 2250), ("B200", 180, "fp8", 4500),
])
def test_more_gpus_in_the_table(name, gb, precision, tflops):
    gpu = lookup(name)
    assert gpu.memory_gb == gb and gpu.peak_flops(precision) == pytest.approx(tflops * 1e12)


def test_v100_has_no_bf16_path_and_flags_override_the_table(capsys):
    with pytest.raises(UserError, match="no dense bf16"):
        lookup("v100").peak_flops("bf16")
    out, _ = _json(capsys, "--params", "7B", "--tokens", "1T", "--gpu", "h100", "--gpu-memory-gb", "96",
                   "--peak-tflops", "900")
    assert out["memory"]["gpu_memory_bytes"] == 96e9 and out["compute"]["peak_tflops_per_gpu"] == 900
    assert "overridden by --gpu-memory-gb and --peak-tflops (bf16)" in out["inputs"]["gpu"]["source"]
    out, _ = _json(capsys, "--params", "7B", "--gpu", "my-npu", "--gpu-memory-gb", "64", "--peak-tflops", "400")
    assert out["inputs"]["gpu"] == {"name": "my-npu", "memory_gb": 64, "peak_tflops": 400, "precision": "bf16",
                                    "source": "--gpu-memory-gb and --peak-tflops"}
    assert main(["estimate", "--params", "7B", "--gpu", "my-npu", "--gpu-memory-gb", "64"]) == 2
    assert "--gpu-memory-gb and --peak-tflops" in capsys.readouterr().err


def test_a_parameter_count_needs_no_seq_len_but_flops_and_activations_say_so(capsys):
    out, _ = _json(capsys, *LLAMA2_7B, "--tokens", "2T")
    assert out["model"]["params"] == 6_738_415_616 and out["model"]["seq_len"] is None
    assert out["compute"] is None and out["compute_needs"] == ["--seq-len"]
    assert out["memory"]["strategies"]["ddp"]["activations"] is None
    assert out["memory"]["strategies"]["fsdp"]["gathered"] > 0  # the shape still gives the layers in flight
    text, _ = _text(capsys, *LLAMA2_7B)
    assert "give --tokens and --seq-len" in text and "activations need --seq-len" in text
    assert main(["estimate", *LLAMA2_7B, "--positions", "learned"]) == 2  # a learned table has s rows
    assert "--seq-len missing: learned positions" in capsys.readouterr().err


def test_json_holds_every_input_and_assumption(capsys):
    out, _ = _json(capsys, "--hf-config", NEMO, "--seq-len", "4096", "--tokens", "1T", "--gpus", "16", "--tp", "2",
                   "--gpu", "b200", "--amp-layout", "megatron", "--activation-checkpointing", "selective")
    inputs = out["inputs"]
    assert {k: inputs[k] for k in ("tokens", "seq_len", "seq_len_source", "gpus", "tp", "pp", "dp", "amp_layout",
                                   "activation_checkpointing", "precision", "mfu", "micro_batch")} == {
        "tokens": 1e12, "seq_len": 4096, "seq_len_source": "--seq-len", "gpus": 16, "tp": 2, "pp": 1, "dp": 8,
        "amp_layout": "megatron", "activation_checkpointing": "selective", "precision": "bf16", "mfu": 0.4,
        "micro_batch": 1}
    assert inputs["gpu"]["name"] == "B200-180GB" and inputs["gpu"]["peak_tflops"] == 2250
    assert set(out["assumptions"]) >= {"units", "optimizer", "flops", "utilisation", "memory", "activations",
                                       "checkpoint", "failures", "seq_len"}
    assert "2+4+12" in out["assumptions"]["optimizer"] and "4,096 from --seq-len" in out["assumptions"]["seq_len"]


def test_numbers_are_formatted_for_people(capsys):
    from hpctrain.planning.auto import size as _size

    assert sig3(1583) == "1,580" and sig3(15.64) == "15.6" and count(1.583e15) == "1,580T"
    assert _size(1.583e12) == "1,580 GB"  # hpctrain plan's sizes, not 1.58e+03 GB
    text, _ = _text(capsys, "--params", "7B", "--tokens", "1580T")
    assert "tokens                         1,580T" in text


def test_plan_json_names_the_machine_world_ranks_per_node_and_global_batch(monkeypatch, capsys):
    """The fields cmd_plan adds, around a stand-in choice (the real search takes seconds)."""
    from hpctrain.cli import plan
    from hpctrain.planning.auto import Candidate, Choice, Machine

    def choose(cfg, env, **_):
        chosen = Candidate("ddp", 1, 1, env.world_size, "none", 4, 2, {"params": 1e9}, 0.1, 80.0, True)
        machine = Machine("cuda", "NVIDIA H100 80GB HBM3", 80e9, 72e9, 4e14, 150e9, 20e9, env.local_world_size)
        return Choice(cfg, chosen, [chosen], {}, machine, 64, None)

    monkeypatch.setattr(plan, "choose", choose)
    assert main(["plan", "-n", "4", "--nodes", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["world"], out["ranks_per_node"], out["nodes"], out["global_batch"]) == (8, 4, 2, 64)
    assert out["machine"]["name"] == "NVIDIA H100 80GB HBM3" and out["machine"]["budget"] == 80e9


class _ClosedPipe(io.StringIO):
    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self) -> None:
        raise BrokenPipeError(32, "Broken pipe")


def test_a_reader_that_left_ends_the_command_quietly(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdout", _ClosedPipe())
    assert main(["estimate", "--params", "7B"]) == EXIT_PIPE
    assert "internal error" not in capsys.readouterr().err


def test_a_closed_pipe_exits_141_without_a_traceback():
    """`hpctrain estimate ... | head -1` with head gone before the first write: the read end is
    closed before the child starts writing, so every run meets the broken pipe (no race)."""
    proc = subprocess.Popen([sys.executable, "-m", "hpctrain", "estimate", "--params", "7B", "--tokens", "1T"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == EXIT_PIPE
    assert err == ""  # neither "internal error" nor Python's "Exception ignored ... BrokenPipeError" at exit


def test_context_parallel_divides_the_activations_and_fsdp_shards_over_dp_x_cp(capsys):
    """--cp 4 on 8 GPUs at 131,072 tokens: dp 2 x cp 4, each GPU holding a quarter of the tokens."""
    llama3 = ["--hf-config", str(CONFIGS / "llama-3-8b.json"), "--seq-len", "131072", "--gpus", "8",
              "--strategy", "fsdp", "--activation-checkpointing", "full"]
    one, _ = _json(capsys, *llama3)
    four, _ = _json(capsys, *llama3, "--cp", "4")
    assert (four["parallel"]["dp"], four["parallel"]["cp"], one["parallel"]["dp"]) == (2, 4, 8)
    a, b = one["memory"]["declared"], four["memory"]["declared"]
    assert b["weights"] == a["weights"] and b["optimizer"] == a["optimizer"]  # sharded over 8 ranks either way
    assert b["activations"] == pytest.approx(a["activations"] / 4, rel=0.02)
    assert main(["estimate", *llama3, "--cp", "3"]) == 2
    assert "--cp 3 = 3 does not divide --gpus 8" in capsys.readouterr().err
