"""A ``from_pretrained`` factory under tensor, pipeline and context parallel (issue 37, item 2):
the checks before start cannot build it on meta (transformers refuses), so they defer to rank 0's
structure after start, and the model takes the fsdp path: rank 0 loads the weights, the other ranks
get its structure, the weights are broadcast into each rank's shards / stages. tp2, pp2 and cp2
(cp's all-gather path on CPU) at 2 gloo ranks (one forked pair) train to one process's losses,
and no rank gives a torch UserWarning while building."""

from __future__ import annotations

import importlib.util
import json
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset

from tests.dist_utils import run_ranks

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                reason="transformers is not installed")

PRETRAINED_ENV = "HPCTRAIN_TEST_PRETRAINED_LLAMA"  # the save_pretrained directory the factory loads
VOCAB, SEQ = 64, 64
NAME = "tests.parallel.test_pretrained_tp_pp"


class Windows(Dataset):
    """Token windows of ``SEQ + 1`` ids (causal_lm), fixed by ``seed``."""

    def __init__(self, n: int, seed: int) -> None:
        self.x = torch.randint(0, VOCAB, (n, SEQ + 1), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.x[i]


def windows() -> dict[str, Any]:
    return {"train": Windows(12, 0), "val": Windows(4, 1), "task": "causal_lm", "vocab_size": VOCAB}


def pretrained() -> torch.nn.Module:
    """A user's factory: a fine-tuning start from disk."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(os.environ[PRETRAINED_ENV])


def _save_pretrained(path: Path) -> None:
    import transformers

    torch.manual_seed(123)  # weights no seed of the run would draw
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    transformers.LlamaForCausalLM(config).save_pretrained(path)


# torch.optim:AdamW: torch's own defaults (hpctrain's adamw asks foreach, which takes no mix of
# DTensor and plain parameters at dp=1)
KEYS = [f"model.name={NAME}:pretrained", f"data.name={NAME}:windows", "data.batch_size=4", "train.log_every=1",
        "train.progress=false", "train.threads=1", "optim.name=torch.optim:AdamW", "optim.lr=0.01",
        "train.max_steps=3", "checkpoint.enabled=false", "telemetry.straggler_every_steps=0", f"model.seq_len={SEQ}"]
CASES = [("tp2", ["parallel.tp=2", "parallel.strategy=fsdp"]),
         ("pp2", ["parallel.pp=2", "parallel.microbatches=2"]),
         ("cp2", ["parallel.cp=2", "parallel.strategy=fsdp"]),
         ("tp2-ddp", ["parallel.tp=2"])]  # the default strategy's path: rank 0's model sent whole


def _train_recording(env: Any, cases: list[tuple[str, list[str]]], root: str) -> dict[str, Any]:
    """Each case through ``train``; its summary's steps (or the error) and torch's UserWarnings."""
    from hpctrain.config import load_config
    from hpctrain.train import train

    out: dict[str, Any] = {}
    for name, keys in cases:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                out[name] = train(load_config(None, [*keys, f"run.dir={root}/{name}"]), env)["steps"]
            except Exception as err:  # noqa: BLE001 - reported per case by the test
                out[name] = f"{type(err).__name__}: {err}"
        out[f"{name}-warnings"] = sorted({str(w.message) for w in caught if issubclass(w.category, UserWarning)
                                          and "torch" in w.filename and "mesh" not in w.filename})
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("pretrained_tp_pp")
    _save_pretrained(root / "llama")
    old = os.environ.get(PRETRAINED_ENV)
    os.environ[PRETRAINED_ENV] = str(root / "llama")  # the ranks inherit it
    try:
        one = run_ranks(1, _train_recording, [("one", KEYS)], str(root))
        ranks = run_ranks(2, _train_recording, [(name, [*KEYS, *extra]) for name, extra in CASES], str(root),
                          timeout=600)
    finally:
        if old is None:
            del os.environ[PRETRAINED_ENV]
        else:
            os.environ[PRETRAINED_ENV] = old
    return root, one + ranks


def _losses(run: Path) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r and "val_loss" not in r]


@pytest.mark.parametrize("name", [name for name, _ in CASES])
def test_a_from_pretrained_factory_trains_as_one_process(runs, name: str) -> None:
    root, results = runs
    assert results[0]["one"] == 3, results[0]
    for rank in results[1:]:
        assert rank[name] == 3, rank[name]
        assert rank[f"{name}-warnings"] == [], rank[f"{name}-warnings"]
    one = _losses(root / "one")  # from the saved weights: a rank that got others would start elsewhere
    assert len(one) == 3
    assert _losses(root / name) == pytest.approx(one, abs=1e-5)


def test_the_checks_defer_a_factory_that_loads_weights(tmp_path: Path, monkeypatch) -> None:
    """No meta structure before start (transformers refuses meta); the check after start, on rank 0's
    structure, is the same exit-2 error (a pipeline deeper than the loaded model's 2 layers)."""
    import transformers

    from hpctrain.core.section import ConfigError
    from hpctrain.parallel.meta import meta_structure
    from hpctrain.parallel.pipeline_strategy import check_stages

    _save_pretrained(tmp_path / "llama")
    monkeypatch.setenv(PRETRAINED_ENV, str(tmp_path / "llama"))
    assert meta_structure(pretrained) is None
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.AutoConfig.from_pretrained(tmp_path / "llama"))
    with pytest.raises(ConfigError, match=r"^parallel.pp=3 cannot cut model.name=x into 3 stages: pipeline: 2 "
                                          r"blocks cannot fill 3 stages"):
        check_stages(model, 3, 3, "x")
