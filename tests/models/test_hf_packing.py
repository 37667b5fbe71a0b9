"""Packed documents for Hugging Face Llama-family models (issue 37, item 2): the model gets
``position_ids`` restarting at each document (transformers' ``DataCollatorWithFlattening`` form;
transformers masks block-diagonally by them), so a window packing two documents gives each one
the logits it gives alone (fp32, 1e-5), PEFT-wrapped too, without the crossing-attention warning."""

from __future__ import annotations

import importlib.util
import logging

import pytest
import torch
from torch import nn

from hpctrain.tasks.inputs import call_model, expand_dict_inputs

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                reason="transformers is not installed")

VOCAB, SEQ, FIRST = 64, 64, 23  # the first document's length; the second fills the window


def hf_llama() -> nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    return transformers.LlamaForCausalLM(config).eval()


def packed() -> dict[str, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(3))
    doc_ids = torch.zeros(1, SEQ, dtype=torch.int32)
    doc_ids[:, FIRST:] = 1
    return {"tokens": tokens, "doc_ids": doc_ids}


def _alone(model: nn.Module, tokens: torch.Tensor) -> list[torch.Tensor]:
    return [model(tokens[:, :FIRST]).logits, model(tokens[:, FIRST:]).logits]


def _check_each_document_alone(model: nn.Module, caplog: pytest.LogCaptureFixture) -> None:
    batch = packed()
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="hpctrain"):
        alone = _alone(model, batch["tokens"])
        evaluated = call_model(model, batch).logits  # evaluation's call
        expand_dict_inputs(model)
        trained = model(batch).logits  # training's: the strategy hands the dict to the model's hook
    for logits in (evaluated, trained):
        torch.testing.assert_close(logits[:, :FIRST], alone[0], rtol=0, atol=1e-5)
        torch.testing.assert_close(logits[:, FIRST:], alone[1], rtol=0, atol=1e-5)
    assert not [r for r in caplog.records if "takes no doc_ids" in r.getMessage()]


def test_each_packed_document_gets_its_logits_alone(caplog: pytest.LogCaptureFixture) -> None:
    _check_each_document_alone(hf_llama(), caplog)


@pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="peft is not installed")
def test_a_peft_wrapped_model_masks_the_documents_too(caplog: pytest.LogCaptureFixture) -> None:
    import peft

    model = peft.get_peft_model(hf_llama(), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    _check_each_document_alone(model, caplog)


def test_without_the_positions_the_second_document_would_see_the_first() -> None:
    """The comparison above can fail: the tokens alone (no document positions) cross the boundary."""
    model = hf_llama()
    batch = packed()
    with torch.no_grad():
        crossing = model(batch["tokens"]).logits[:, FIRST:]
        alone = _alone(model, batch["tokens"])[1]
    assert float((crossing - alone).abs().max()) > 1e-2
