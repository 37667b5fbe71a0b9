"""LoRA as users expect it (issue 38, point 2): a PEFT model trains with its base frozen; each
checkpoint holds the trained tensors and their optimizer state only, with the base's digest;
a resume on another base is refused (exit 2) and on the same one continues bit for bit;
``hpctrain ckpt export --adapters`` writes what ``PeftModel.from_pretrained`` loads and
``--merged`` what ``merge_and_unload`` gives; ``hpctrain eval`` reads the checkpoint. One
process in-process, and FSDP at 2 gloo ranks (its DCP checkpoint resumed by one process, and
the one process's checkpoint resumed under FSDP)."""

from __future__ import annotations

import importlib.util
import json
import os
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from hpctrain.checkpoint import layout
from hpctrain.cli import main as cli_main
from hpctrain.config import load_config
from hpctrain.train import train
from hpctrain.weights.frozen import base_digest, read_base_record
from hpctrain.weights.locate import checkpoint_source
from tests.dist_utils import train_cases

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="no peft (the test extras)"),
              pytest.mark.slow]

BASE_ENV = "HPCTRAIN_TEST_LORA_BASE"  # the base model's folder, for tiny_lora (every rank reads it)
VOCAB, SEQ = 256, 16


def tiny_lora() -> nn.Module:
    """A tiny Llama from its folder with LoRA on q_proj and v_proj (rank 4), as users write it."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    base = LlamaForCausalLM.from_pretrained(os.environ[BASE_ENV])
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    return get_peft_model(base, config)


def _save_base(path: Path, seed: int) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def _corpus(path: Path) -> Path:
    rng = random.Random(0)
    words = "the quick brown fox jumps over a lazy dog while old kings sing".split()
    path.mkdir()
    for split, count in (("train", 48), ("val", 8)):
        rows = [json.dumps({"text": " ".join(rng.choices(words, k=24))}) for _ in range(count)]
        (path / f"{split}.jsonl").write_text("\n".join(rows) + "\n")
    return path


@pytest.fixture(scope="module")
def where(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    root = tmp_path_factory.mktemp("lora")
    paths = {"base": _save_base(root / "base", 0), "other": _save_base(root / "other", 1),
             "corpus": _corpus(root / "corpus"), "root": root}
    before = os.environ.get(BASE_ENV)
    os.environ[BASE_ENV] = str(paths["base"])
    yield paths
    if before is None:
        os.environ.pop(BASE_ENV, None)
    else:
        os.environ[BASE_ENV] = before


def _keys(where: dict[str, Path]) -> list[str]:
    return ["model.name=tests.test_lora:tiny_lora", "train.task=causal_lm", f"data.name=jsonl:{where['corpus']}",
            f"model.seq_len={SEQ}", "data.batch_size=4", "data.max_val_samples=8", "optim.name=adamw",
            "optim.lr=0.01", "train.progress=false", "train.threads=1", "checkpoint.every_seconds=None"]


@pytest.fixture(scope="module")
def lora_run(where: dict[str, Path]) -> Path:
    run = where["root"] / "run"
    train(load_config(None, [*_keys(where), "train.max_steps=4", "checkpoint.every_steps=2", f"run.dir={run}"]))
    return run


def _ckpt(run: Path, step: int) -> Path:
    return run / "checkpoints" / layout.step_name(step)


def _trained_names(model: nn.Module) -> list[str]:
    return sorted(n for n, p in model.named_parameters() if p.requires_grad)


def test_a_checkpoint_holds_the_trained_tensors_and_the_base_digest_only(where: dict[str, Path],
                                                                          lora_run: Path) -> None:
    model = tiny_lora()
    ckpt = _ckpt(lora_run, 4)
    assert [s.name for s in checkpoint_source(ckpt).specs] == _trained_names(model)  # 8 LoRA matrices, no base
    record = read_base_record(ckpt)
    assert record is not None and record["sha256"] == base_digest(model)
    assert record["parameters"] == sum(not p.requires_grad for p in model.parameters())
    saved = torch.load(ckpt / "replicated.pt", weights_only=True)
    assert set(saved["optimizer"]["state"]) == set(range(len(_trained_names(model))))  # Adam state: trained only
    trained_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    assert sum(s.nbytes for s in checkpoint_source(ckpt).specs) == trained_bytes
    # the tensors (trained weights and Adam's two moments) against the whole model, which model.pt holds
    assert (ckpt / "replicated.safetensors").stat().st_size * 5 < (lora_run / "model.pt").stat().st_size


def test_resume_on_another_base_is_refused_and_on_the_same_one_continues_bit_for_bit(
        where: dict[str, Path], lora_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    resumed = [*_keys(where), "train.max_steps=4", "checkpoint.every_steps=2", f"resume={_ckpt(lora_run, 2)}"]
    monkeypatch.setenv(BASE_ENV, str(where["other"]))
    assert cli_main(["train", *resumed, f"run.dir={tmp_path / 'other'}"]) == 2
    err = capsys.readouterr().err
    assert f"checkpoint {_ckpt(lora_run, 2)} was trained on another frozen base" in err and "Traceback" not in err
    monkeypatch.setenv(BASE_ENV, str(where["base"]))
    summary = train(load_config(None, [*resumed, f"run.dir={tmp_path / 'same'}"]))
    whole = json.loads((lora_run / "summary.json").read_text())
    assert summary["params_sha256"] == whole["params_sha256"] and summary["steps"] == 4


def test_adapters_export_loads_in_peft_and_merged_export_is_merge_and_unload(where: dict[str, Path],
                                                                            lora_run: Path, tmp_path: Path) -> None:
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    assert cli_main(["ckpt", "export", str(lora_run), "--adapters", str(tmp_path / "ad")]) == 0
    assert sorted(p.name for p in (tmp_path / "ad").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    loaded = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(where["base"]), tmp_path / "ad").eval()
    trained = tiny_lora()
    trained.load_state_dict(torch.load(lora_run / "model.pt", weights_only=True))
    tokens = torch.randint(0, VOCAB, (2, SEQ))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=tokens).logits, trained.eval()(input_ids=tokens).logits)
        merged_ref = {k: v.clone() for k, v in loaded.merge_and_unload().state_dict().items()}
    assert cli_main(["ckpt", "export", str(lora_run), "--merged", str(tmp_path / "merged.safetensors")]) == 0
    merged = load_file(tmp_path / "merged.safetensors")
    assert merged.keys() == merged_ref.keys() and all(torch.equal(merged[k], merged_ref[k]) for k in merged)


def test_exports_that_cannot_be_a_model_are_refused(where: dict[str, Path], lora_run: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["ckpt", "export", str(lora_run), str(tmp_path / "w.safetensors")]) == 2
    assert "holds only the trained parameters of a frozen base (LoRA)" in capsys.readouterr().err
    assert cli_main(["ckpt", "export", str(lora_run), "--merged", str(tmp_path / "m.safetensors"),
                     "--base", str(where["other"])]) == 2
    assert "is not the one checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "w.safetensors").exists() and not (tmp_path / "m.safetensors").exists()


def test_eval_of_a_lora_checkpoint_equals_eval_of_the_runs_model(where: dict[str, Path], lora_run: Path,
                                                                 tmp_path: Path) -> None:
    keys = [k for k in _keys(where) if not k.startswith("checkpoint.")]
    for name, weights in (("ckpt", _ckpt(lora_run, 4)), ("model", lora_run / "model.pt")):
        assert cli_main(["eval", *keys, "--weights", str(weights), "--out", str(tmp_path / name)]) == 0
    ckpt, model = (json.loads((tmp_path / n / "eval.json").read_text()) for n in ("ckpt", "model"))
    assert ckpt["loss"] == model["loss"] and ckpt["count"] == model["count"] > 0


def test_fsdp_at_two_ranks_saves_the_trained_tensors_and_resumes_across_layouts(where: dict[str, Path],
                                                                                lora_run: Path,
                                                                                tmp_path: Path) -> None:
    keys = [*_keys(where), "parallel.strategy=fsdp", "train.max_steps=4", "checkpoint.every_steps=2"]
    out = train_cases(2, [("fsdp", keys), ("from_whole", [*keys, f"resume={_ckpt(lora_run, 2)}"])], tmp_path,
                      keep=("steps", "params_sha256"))
    assert out[0]["fsdp"]["steps"] == 4 and out[0]["from_whole"]["steps"] == 4, out
    ckpt = _ckpt(tmp_path / "fsdp", 2)
    assert layout.read_manifest(ckpt)["format"] == "dcp"
    assert [s.name for s in checkpoint_source(ckpt).specs] == _trained_names(tiny_lora())
    assert read_base_record(ckpt)["sha256"] == base_digest(tiny_lora())  # type: ignore[index]
    one = train(load_config(None, [*_keys(where), "train.max_steps=4", f"resume={ckpt}",
                                   f"run.dir={tmp_path / 'one'}"]))
    assert one["steps"] == 4
