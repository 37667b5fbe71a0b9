"""gpt's model.bias=false (issue 43): nanoGPT's bias=False layout, no linear nor layer-norm biases."""

from __future__ import annotations

import pytest
import torch

from hpctrain.config import ConfigError, load_config
from hpctrain.models import build_model, count_parameters
from hpctrain.models.gpt import GPT, GPTShape


def test_no_biases_anywhere_and_the_count_matches_the_formula() -> None:
    shape = GPTShape(vocab=65, seq_len=16, n_layers=2, hidden=32, heads=4, bias=False)
    model = GPT(shape)
    names = [name for name, _ in model.named_parameters()]
    assert not [n for n in names if n.endswith(".bias")]
    h = 32
    assert count_parameters(model) == 2 * (12 * h * h + 2 * h) + (65 + 16) * h + h == shape.params
    assert len(names) == 2 * 8 + 3  # 8 per block (ln1, q, k, v, o, ln2, up, down) + embeddings, ln_f


def test_the_key_builds_it_the_default_keeps_the_biases_and_other_models_refuse_it() -> None:
    assert load_config(None, ["model.name=gpt"]).model.bias is True
    cfg = load_config(None, ["model.name=gpt", "model.n_layers=1", "model.hidden=32", "model.seq_len=16",
                             "model.bias=false"])
    model = build_model("gpt", 256, input_shape=(16,), input_dtype=torch.long, config=cfg.model)
    assert isinstance(model, GPT) and model.blocks[0].attn.q.bias is None and model.ln_f.bias is None
    with pytest.raises(ConfigError, match=r"^model.bias=false applies to model.name=gpt only \(got model.name=llama\)"):
        load_config(None, ["model.name=llama", "model.bias=false"])


def test_the_default_layout_draws_the_same_weights_as_before() -> None:
    """The bias switch moved no draw: weights of a seeded default gpt equal those drawn by hand in
    reset_parameters' order (embeddings, then each block's q, k, v, o, up, down)."""
    torch.manual_seed(5)
    model = GPT(GPTShape(vocab=64, seq_len=8, n_layers=1, hidden=16, heads=2))
    torch.manual_seed(5)
    tok, pos = torch.empty(64, 16).normal_(0, 0.02), torch.empty(8, 16).normal_(0, 0.02)
    q = torch.empty(16, 16).normal_(0, 0.02)
    assert torch.equal(model.tok_emb.weight, tok) and torch.equal(model.pos_emb.weight, pos)
    assert torch.equal(model.blocks[0].attn.q.weight, q)
