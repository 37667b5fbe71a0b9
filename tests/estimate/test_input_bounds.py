"""`hpctrain estimate`'s inputs are bounded and checked (issue 42 point 3, issue 39 point 5): a
config.json is read as a bounded regular file, sizes beyond physical sense are refused at once,
and each of the eleven inputs the issue names ends in one line and exit 2 (or a right answer)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from hpctrain.cli import main
from hpctrain.estimate import bounds

CONFIGS = Path(__file__).parent / "hf_configs"
LLAMA3_8B = json.loads((CONFIGS / "llama-3-8b.json").read_text())
SHAPE = ["--layers", "2", "--hidden", "64", "--heads", "4", "--vocab", "100", "--seq-len", "8"]


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = main(["estimate", *argv])
    except SystemExit as stop:  # argparse's own errors
        code = int(stop.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def _refused(capsys, *argv: str) -> str:
    """The one line of an exit-2 refusal (no traceback, no usage block)."""
    code, out, err = _run(capsys, *argv)
    assert (code, out) == (2, ""), (code, out, err)
    assert err.startswith("hpctrain estimate: error: ") and err.count("\n") == 1, err
    return err


def _config(tmp_path: Path, **edit: object) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA3_8B, **edit}))
    return str(path)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_or_a_device_as_config_is_refused_without_reading(tmp_path, capsys):
    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)
    start = time.monotonic()
    assert "a FIFO, not a regular file" in _refused(capsys, "--hf-config", str(fifo))
    zero = tmp_path / "zero.json"
    zero.symlink_to("/dev/zero")
    assert "a character device, not a regular file" in _refused(capsys, "--hf-config", str(zero))
    assert time.monotonic() - start < 2


def test_a_config_larger_than_the_limit_names_the_limit_and_how_to_raise_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HPCTRAIN_MAX_HF_CONFIG_BYTES", "100")
    err = _refused(capsys, "--hf-config", _config(tmp_path))
    assert "HPCTRAIN_MAX_HF_CONFIG_BYTES" in err and "more than the 100" in err


@pytest.mark.parametrize("text, message", [
    (json.dumps({**LLAMA3_8B, "hidden_size": 10 ** 30}), "key 'hidden_size' 1,000,000,000,000,000,000,000,000,000,000 "
                                                          "is beyond any real model (at most 1,099,511,627,776)"),
    (json.dumps(LLAMA3_8B)[:-1] + ', "vocab_size": ' + "9" * 5000 + "}", "not a readable JSON file (Exceeds the limit"),
    ("[" * 100_000 + "]" * 100_000, "not a readable JSON file (maximum recursion depth"),
    (json.dumps({**LLAMA3_8B, "model_type": "mixtral", "num_local_experts": 10 ** 12, "num_experts_per_tok": 2}),
     "key 'num_local_experts' 1,000,000,000,000 is beyond any real model (at most 16,384)"),
    (json.dumps({**LLAMA3_8B, "num_key_value_heads": 0}),
     "key 'num_key_value_heads' is 0, expected a positive integer"),
    (json.dumps({**LLAMA3_8B, "tie_word_embeddings": "false"}), "key 'tie_word_embeddings' is 'false', expected true"),
    (json.dumps({**LLAMA3_8B, "attention_dropout": "0.1"}), "key 'attention_dropout' is '0.1', expected a probability"),
    (json.dumps({**LLAMA3_8B, "model_type": ["llama"]}), "model_type ['llama'] is not supported"),
    (json.dumps({**LLAMA3_8B, "num_hidden_layers": 10 ** 6}), "key 'num_hidden_layers' 1,000,000 is beyond any real"),
], ids=["1e30", "5000-digits", "deep", "experts-1e12", "kv-0", "tie-string", "dropout-string", "type-list",
        "layers-1e6"])
def test_hostile_configs_exit_2_in_one_line(text, message, tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(text)
    start = time.monotonic()
    err = _refused(capsys, "--hf-config", str(path))
    assert message in err and str(path) in err
    assert time.monotonic() - start < 2


def test_a_missing_kv_heads_key_is_multi_head_attention_and_false_is_untied(tmp_path, capsys):
    """The right answers: absent num_key_value_heads is MHA (transformers' default); JSON false
    unties (Llama 3 8B: 8.03B, not the tied 7.50B)."""
    config = {k: v for k, v in LLAMA3_8B.items() if k != "num_key_value_heads"}
    path = tmp_path / "mha.json"
    path.write_text(json.dumps(config))
    code, out, _ = _run(capsys, "--hf-config", str(path), "--json")
    assert code == 0 and json.loads(out)["model"]["shape"]["kv_heads"] == LLAMA3_8B["num_attention_heads"]
    code, out, _ = _run(capsys, "--hf-config", _config(tmp_path, tie_word_embeddings=False), "--json")
    assert code == 0 and json.loads(out)["model"]["params"] == 8_030_261_248


@pytest.mark.parametrize("argv, message", [
    ([*SHAPE[:4], "--heads", "0", *SHAPE[6:]], "--heads must be a positive integer, got 0"),
    (["--params", "1e400"], "--params 1e400 is beyond any real job"),
    (["--params", "1e30"], "--params 1e30 is beyond any real job"),
    (["--params=-7B"], "--params -7B must be a count of at least 1"),
    (["--params", "-7B"], "argument --params: expected one argument; hint: a value that starts with '-' reads as a "
                          "flag: write it as FLAG=VALUE (e.g. --params=-7B)"),
    (["--params", "7B", "--achieved-tflops", "2000"],
     "--achieved-tflops 2000 exceeds the dense peak of h100-sxm at bf16, 989.4 TFLOP/s"),
    (["--params", "7B", "--gpu-memory-gb", "nan"], "--gpu-memory-gb is NaN, not a number"),
    (["--params", "7B", "--peak-tflops", "inf"], "--peak-tflops is infinite"),
    (["--params", "7B", "--mfu", "nan"], "--mfu nan must be a fraction in (0, 1]"),
    (["--params", "7B", "--mtbf-hours", "inf"], "--mtbf-hours is infinite"),
    (["--params", "7B", "--gpus", "2000000"], "--gpus 2,000,000 is beyond any real job (at most 1,048,576)"),
    (["--params", "7B", "--tokens", "1e300"], "--tokens 1e300 is beyond any real job"),
    (["--params", "7B", "--micro-batch", "4000000", "--grad-accum", "4000"],
     "a global batch of 16,000,000,000 samples is beyond any real job (at most 2^32"),
    ([*SHAPE[:-1], "4000000", "--micro-batch", "1000000"], "elements a step"),
    (["--layers", "1000000000", "--hidden", "1000000000", "--heads", "8", "--vocab", "100", "--seq-len", "8"],
     "--layers 1,000,000,000 is beyond any real model (at most 16,384)"),
    (["--layers", "100", "--hidden", "1048576", "--heads", "8", "--vocab", "100", "--seq-len", "8"],
     "one block's parameters come to"),
    ([*SHAPE, "--experts", "16384", "--layers", "1024"], "expert MLPs"),
])
def test_each_bad_flag_exits_2_in_one_line_at_once(argv, message, capsys):
    start = time.monotonic()
    err = _refused(capsys, *argv)
    assert message in err
    assert time.monotonic() - start < 1  # refused before anything is computed


def test_the_limits_leave_todays_largest_jobs_alone(capsys):
    """Llama 3 405B on 16,384 GPUs with its 16M-token batch, and a 2T-token run, are planned as before."""
    code, out, err = _run(capsys, "--layers", "126", "--hidden", "16384", "--heads", "128", "--kv-heads", "8",
                          "--ffn-hidden", "53248", "--vocab", "128256", "--seq-len", "8192", "--mlp", "swiglu",
                          "--untied-embeddings", "--positions", "rotary", "--norm", "rmsnorm", "--bias", "none",
                          "--gpus", "16384", "--tp", "8", "--pp", "16", "--micro-batch", "1", "--grad-accum", "16",
                          "--tokens", "15.6T", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert 405e9 < result["model"]["params"] < 406e9 and result["compute"]["wall_days"] > 0
    assert bounds.MAX_GPUS >= 16384 and 2048 * 8192 <= bounds.MAX_ELEMENTS
