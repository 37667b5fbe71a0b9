"""Pretrained weights under sharding (issue 24, point 4): a factory calling ``from_pretrained`` (which
refuses the meta device) trains under fsdp as under ddp, from the same weights: rank 0 builds it once
in host memory, every rank shards its meta structure and gets rank 0's weights. The first loss is
equal, the end weights equal within tolerance, and after one step of a tiny lr ``model.pt`` is the saved model."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset

from tests.dist_utils import train_cases

# three 2-rank runs of a Hugging Face model; transformers is imported only where they run
pytestmark = [pytest.mark.slow, pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                                   reason="transformers is not installed")]

PRETRAINED_ENV = "HPCTRAIN_TEST_PRETRAINED"  # the save_pretrained directory the factory loads
VOCAB, SEQ = 64, 16
NAME = "tests.models.test_pretrained_sharded"
# compared with ddp: fsdp (hsdp is the same class; deepspeed takes the same path in build_structure,
# checked by hand: its import alone would double this test's time)
SHARDED = ("fsdp",)


class Windows(Dataset):
    """Token windows of ``SEQ + 1`` ids (causal_lm), fixed by ``seed``."""

    def __init__(self, n: int, seed: int) -> None:
        self.x = torch.randint(0, VOCAB, (n, SEQ + 1), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.x[i]


def windows() -> dict[str, Any]:
    return {"train": Windows(32, 0), "val": Windows(8, 1), "task": "causal_lm", "vocab_size": VOCAB}


def pretrained_gpt2() -> torch.nn.Module:
    """What a user's factory does: load a fine-tuning start from disk."""
    import transformers

    return transformers.GPT2LMHeadModel.from_pretrained(os.environ[PRETRAINED_ENV])


def _save_pretrained(path: Path) -> dict[str, torch.Tensor]:
    import transformers

    torch.manual_seed(123)  # weights no seed of the run would draw
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ, bos_token_id=None, eos_token_id=None))
    model.save_pretrained(path)
    return {k: v.clone() for k, v in model.state_dict().items()}


KEYS = [f"model.name={NAME}:pretrained_gpt2", f"data.name={NAME}:windows", "data.batch_size=4", "train.log_every=1",
        "train.progress=false", "train.threads=1", "optim.name=adamw", "checkpoint.enabled=false",
        "telemetry.straggler_every_steps=0"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], dict[str, torch.Tensor]]:
    root = tmp_path_factory.mktemp("pretrained")
    saved = _save_pretrained(root / "gpt2")
    cases = [(strategy, [*KEYS, f"parallel.strategy={strategy}", "optim.lr=0.01", "train.max_steps=3"])
             for strategy in ("ddp", *SHARDED)]
    # one step too small to move a weight visibly: model.pt shows where training started
    cases.append(("fsdp-lr0", [*KEYS, "parallel.strategy=fsdp", "optim.name=sgd", "optim.lr=1e-12",
                               "train.max_steps=1"]))
    old = os.environ.get(PRETRAINED_ENV)
    os.environ[PRETRAINED_ENV] = str(root / "gpt2")  # the ranks inherit it
    try:
        summaries = train_cases(2, cases, root, keep=("steps", "val_loss"))[0]
    finally:
        if old is None:
            del os.environ[PRETRAINED_ENV]
        else:
            os.environ[PRETRAINED_ENV] = old
    return root, summaries, saved


def _losses(run: Path) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r and "val_loss" not in r]


def _weights(run: Path) -> dict[str, torch.Tensor]:
    state = torch.load(run / "model.pt", map_location="cpu", weights_only=True)
    return state.get("model", state) if isinstance(state, dict) else state


def test_a_from_pretrained_factory_fine_tunes_under_fsdp_as_under_ddp(runs):
    root, summaries, _ = runs
    ddp = _losses(root / "ddp")
    end_ddp = _weights(root / "ddp")
    assert len(ddp) == 3
    for strategy in SHARDED:
        assert isinstance(summaries[strategy], dict) and summaries[strategy]["steps"] == 3, summaries
        losses = _losses(root / strategy)
        assert len(losses) == 3
        assert losses[0] == pytest.approx(ddp[0], abs=1e-6), strategy  # the same starting weights
        end = _weights(root / strategy)
        assert set(end) == set(end_ddp), strategy
        for name, value in end_ddp.items():
            torch.testing.assert_close(end[name], value, rtol=1e-4, atol=1e-5, msg=f"{strategy} {name}")


def test_the_sharded_model_starts_from_the_saved_weights(runs):
    root, summaries, saved = runs
    assert isinstance(summaries["fsdp-lr0"], dict), summaries
    weights = _weights(root / "fsdp-lr0")
    for name, value in saved.items():
        if name in weights:  # model.pt holds each tied weight once
            torch.testing.assert_close(weights[name], value, rtol=0, atol=1e-9, msg=name)
    assert "transformer.wte.weight" in weights and "transformer.h.1.mlp.c_fc.weight" in weights


def test_the_structure_rank_0_sends_has_no_weights_and_keeps_the_hooks() -> None:
    import pickle

    from hpctrain.parallel.meta import meta_copy
    from hpctrain.tasks.inputs import expand_dict_inputs

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    expand_dict_inputs(model)  # every task model has this hook: it must pickle (not a closure)
    sent = pickle.loads(pickle.dumps(meta_copy(model)))
    assert all(t.is_meta for t in [*sent.parameters(), *sent.buffers()])
    assert [n for n, _ in sent.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert len(sent._forward_pre_hooks) == 1
    assert not model[0].weight.is_meta  # the original keeps its weights
