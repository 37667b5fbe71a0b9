"""Pipeline parallel with dict inputs (issue 37, item 2): packed documents' ``{tokens, doc_ids}``
and ``{input_ids, attention_mask}`` reach every stage, so pp2 masks attention as one process does.
The built-in llama and a Hugging Face Llama, 2 gloo ranks (one forked pair for every case), step-0
losses within 1e-5 and gradients within 1e-6 of one process (the pp tests' tolerances). The
schedule's loss is the mean of the micro-batches' means, so the one-process reference is too."""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hpctrain.tasks.inputs import IGNORE_INDEX, call_model
from tests.dist_utils import run_ranks

VOCAB, SEQ, BATCH, MICRO = 64, 64, 4, 2
HAS_HF = importlib.util.find_spec("transformers") is not None


def llama() -> nn.Module:
    from hpctrain.config.model import ModelConfig
    from hpctrain.models.llama import build_llama

    torch.manual_seed(0)
    cfg = ModelConfig(name="llama", n_layers=2, hidden=64, heads=4, kv_heads=2, seq_len=SEQ, vocab=VOCAB,
                      tie_weights=False)
    return build_llama(VOCAB, config=cfg)


def hf_llama() -> nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                      attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(config)


def packed_batch() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Windows of several documents each (the last one padded: id SEQ), targets -100 across a boundary."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    docs = torch.zeros(BATCH, SEQ + 1, dtype=torch.int32)
    for row, cuts in enumerate(([9, 30], [40], [5, 6, 50], [20, 44])):
        for cut in cuts:
            docs[row, cut:] += 1
    docs[3, 58:] = SEQ  # padding
    inputs = {"tokens": tokens[:, :-1], "doc_ids": docs[:, :-1]}
    crossing = (docs[:, 1:] != docs[:, :-1]) | (docs[:, 1:] >= SEQ)
    return inputs, tokens[:, 1:].masked_fill(crossing, IGNORE_INDEX)


def padded_batch() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``{input_ids, attention_mask}`` with right padding of different lengths."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    mask = torch.ones_like(ids)
    for row, length in enumerate((SEQ + 1, 40, 50, 12)):
        mask[row, length:] = 0
    targets = ids[:, 1:].masked_fill(mask[:, 1:] == 0, IGNORE_INDEX)
    return {"input_ids": ids[:, :-1], "attention_mask": mask[:, :-1]}, targets


def loss_fn(out: Any, targets: torch.Tensor) -> torch.Tensor:
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX)


CASES = {"llama-packed": (llama, packed_batch), "hf-packed": (hf_llama, packed_batch),
         "hf-padded": (hf_llama, padded_batch)}


def _pp_rank(env: Any, names: list[str]) -> dict[str, Any]:
    """Every case through a 2-stage GPipe step: the loss and this rank's step-0 gradients (whole-model names)."""
    from hpctrain.config.parallel import ParallelConfig
    from hpctrain.parallel import build_pipeline_step, mesh_for

    cfg = ParallelConfig(pp=2, microbatches=MICRO, pp_schedule="gpipe")
    _, mesh = mesh_for(env, cfg)
    out = {}
    for name in names:
        factory, batch = CASES[name]
        step = build_pipeline_step(factory(), env, cfg, device=torch.device("cpu"), loss_fn=loss_fn, mesh=mesh)
        inputs, targets = batch()
        loss = step(inputs, targets)
        grads = {step.global_name(n): p.grad.detach().clone() for n, p in step.model.named_parameters()}
        out[name] = {"loss": float(loss), "grads": grads}
    return out


def _reference(name: str) -> dict[str, Any]:
    """One process: the mean of the micro-batches' mean losses, and its gradients."""
    factory, batch = CASES[name]
    model = factory()
    inputs, targets = batch()
    size = BATCH // MICRO
    loss = sum(loss_fn(call_model(model, {k: v[i * size:(i + 1) * size] for k, v in inputs.items()}),
                       targets[i * size:(i + 1) * size]) for i in range(MICRO)) / MICRO
    loss.backward()
    return {"loss": float(loss.detach()), "grads": {n: p.grad for n, p in model.named_parameters()}}


@functools.lru_cache(maxsize=None)
def _ranks() -> list[dict[str, Any]]:
    return run_ranks(2, _pp_rank, [n for n in CASES if HAS_HF or not n.startswith("hf")])


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.skipif(
    n.startswith("hf") and not HAS_HF, reason="transformers is not installed")) for n in CASES])
def test_pp2_with_dict_inputs_equals_one_process(name: str) -> None:
    ranks, ref = _ranks(), _reference(name)
    assert [r[name]["loss"] for r in ranks] == pytest.approx([ref["loss"]] * 2, abs=1e-5)
    grads = {**ranks[0][name]["grads"], **ranks[1][name]["grads"]}
    assert grads.keys() == ref["grads"].keys()
    assert max(float((grads[k] - g).abs().max()) for k, g in ref["grads"].items()) <= 1e-6


def test_the_masks_matter_in_these_batches() -> None:
    """The same batches without their masks give other losses: the comparison above can fail."""
    model = llama()
    inputs, targets = packed_batch()
    masked = loss_fn(call_model(model, inputs), targets)
    crossing = loss_fn(model(inputs["tokens"]), targets)
    assert abs(float(masked) - float(crossing)) > 1e-3
