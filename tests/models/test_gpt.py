"""The registered GPT: sizes from config, parameter count by formula, causal, TP/FSDP-friendly layout."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hpctrain.config import ConfigError, load_config
from hpctrain.models import REGISTRY, ModelError, build_model, count_parameters
from hpctrain.models.gpt import GPT, GPTShape
from hpctrain.models.shape import TransformerShape

SMALL = GPTShape(vocab=256, seq_len=16, n_layers=2, hidden=32, heads=4)


def _hand_count(layers: int, h: int, vocab: int, seq: int, tied: bool) -> int:
    attention = 4 * (h * h + h)                    # q, k, v, o with biases
    mlp = (h * 4 * h + 4 * h) + (4 * h * h + h)    # up, down with biases
    norms = 2 * 2 * h                              # ln1, ln2
    embeddings = vocab * h + seq * h
    head = 0 if tied else vocab * h                # no bias
    return layers * (attention + mlp + norms) + embeddings + 2 * h + head


@pytest.mark.parametrize("tied", [True, False])
def test_parameter_count_matches_the_hand_formula(tied):
    shape = GPTShape(vocab=300, seq_len=24, n_layers=3, hidden=48, heads=6, tie_weights=tied)
    model = GPT(shape)
    assert count_parameters(model) == _hand_count(3, 48, 300, 24, tied) == shape.params
    if tied:  # the estimator's transformer arithmetic counts the same model
        assert shape.params == TransformerShape(layers=3, hidden=48, heads=6, seq_len=24, vocab=300).params
        assert model.head.weight is model.tok_emb.weight


def test_sizes_come_from_the_model_config():
    cfg = load_config(None, ["model.name=gpt", "model.n_layers=3", "model.hidden=64", "model.heads=8",
                             "model.seq_len=32", "model.tie_weights=false"])
    model = build_model("gpt", 256, input_shape=(32,), input_dtype=torch.long, config=cfg.model)
    assert isinstance(model, GPT) and len(model.blocks) == 3
    assert count_parameters(model) == _hand_count(3, 64, 256, 32, False)
    assert model(torch.randint(0, 256, (2, 32))).shape == (2, 32, 256)
    assert REGISTRY["gpt"].input_dtype == torch.long


def test_changing_a_later_token_never_changes_earlier_logits():
    torch.manual_seed(0)
    model = GPT(SMALL).eval()
    tokens = torch.randint(0, 256, (2, 16))
    base = model(tokens)
    for t in (0, 7, 14):
        changed = tokens.clone()
        changed[:, t + 1] = (changed[:, t + 1] + 1) % 256
        out = model(changed)
        assert torch.equal(out[:, : t + 1], base[:, : t + 1])
        assert not torch.allclose(out[:, t + 1], base[:, t + 1])


def test_init_is_deterministic_from_the_seed_and_reset_parameters_redraws_it():
    torch.manual_seed(3)
    first = GPT(SMALL)
    torch.manual_seed(3)
    second = GPT(SMALL)
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), second.state_dict().values()))
    with torch.device("meta"):  # FSDP's path: build without memory, then materialize and reset
        lazy = GPT(SMALL)
    lazy.to_empty(device="cpu")
    torch.manual_seed(3)
    lazy.reset_parameters()
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), lazy.state_dict().values()))
    assert lazy.head.weight is lazy.tok_emb.weight  # still tied after to_empty
    o, q = first.blocks[0].attn.o.weight, first.blocks[0].attn.q.weight
    assert o.std() < q.std()  # residual projections start scaled down by 1/sqrt(2 n_layers)
    assert torch.equal(first.ln_f.weight, torch.ones(32)) and torch.equal(first.blocks[1].mlp.up.bias, torch.zeros(128))


def test_layout_is_what_fsdp_and_tensor_parallel_plans_name():
    """Read by the plans themselves: tensor parallel's plan of every block is columns on q, k, v,
    up and rows on o, down, and a block holds no other Linear (nothing left unsplit); the widths
    are the ones a column/row split needs; FSDP's units are the blocks; the pipeline finds the
    embeddings registered before ``blocks`` and the final norm and head after it."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from hpctrain.parallel.fsdp import shard_units
    from hpctrain.parallel.tensor import block_plan

    model, h = GPT(SMALL), SMALL.hidden
    assert isinstance(model.blocks, nn.ModuleList) and len(model.blocks) == SMALL.n_layers
    columns, rows = ("attn.q", "attn.k", "attn.v", "mlp.up"), ("attn.o", "mlp.down")
    widths = {"attn.q": (h, h), "attn.k": (h, h), "attn.v": (h, h), "attn.o": (h, h),
              "mlp.up": (h, 4 * h), "mlp.down": (4 * h, h)}  # (in, out) features
    for block in model.blocks:
        styles = {name: type(style) for name, style in block_plan(block).items()}
        assert styles == {**dict.fromkeys(columns, ColwiseParallel), **dict.fromkeys(rows, RowwiseParallel)}
        linears = {name: (m.in_features, m.out_features) for name, m in block.named_modules()
                   if isinstance(m, nn.Linear)}
        assert linears == widths
    units = shard_units(model)
    assert len(units) == SMALL.n_layers and all(u is b for u, b in zip(units, model.blocks))
    assert [name for name, _ in model.named_children()] == ["tok_emb", "pos_emb", "drop", "blocks", "ln_f", "head"]


def test_attention_runs_on_a_head_shard():
    """Tensor parallelism gives a rank half the heads (columns of q, k, v; rows of o): the same
    code must run on that shard, and the two shards' partial outputs sum to the full output."""
    torch.manual_seed(0)
    attn = GPT(SMALL).blocks[0].attn.eval()
    x = torch.randn(2, 16, 32)
    full = attn(x)
    parts = []
    for half in (slice(0, 16), slice(16, 32)):
        shard = type(attn)(32, 4, 0.0).eval()  # head_dim 8, as in the full module
        with torch.no_grad():
            for name in ("q", "k", "v"):  # column shards: 2 of the 4 heads
                setattr(shard, name, nn.Linear(32, 16))
                getattr(shard, name).weight.copy_(getattr(attn, name).weight[half])
                getattr(shard, name).bias.copy_(getattr(attn, name).bias[half])
            shard.o = nn.Linear(16, 32, bias=False)  # row shard; the bias is added once, after the sum
            shard.o.weight.copy_(attn.o.weight[:, half])
            parts.append(shard(x))
    torch.testing.assert_close(parts[0] + parts[1] + attn.o.bias, full, rtol=1e-5, atol=1e-6)


def test_wrong_sizes_fail_with_the_key_to_change():
    tokens = {"input_dtype": torch.long}
    with pytest.raises(ModelError, match="model.seq_len=32"):
        build_model("gpt", 256, input_shape=(32,), config=load_config(None, ["model.seq_len=16"]).model, **tokens)
    with pytest.raises(ModelError, match="model.vocab=100"):
        build_model("gpt", 256, input_shape=(16,), config=load_config(None, ["model.vocab=100"]).model, **tokens)
    with pytest.raises(ModelError, match="reads token ids"):  # image data for a language model
        build_model("gpt", 10, input_shape=(1, 28, 28), input_dtype=torch.float32)
    with pytest.raises(ModelError, match="data.name=shakespeare"):  # float features of a token-like shape
        build_model("gpt", 10, input_shape=(128,), input_dtype=torch.float32)
    with pytest.raises(ConfigError, match="model.hidden"):
        load_config(None, ["model.hidden=30", "model.heads=4"])
    with pytest.raises(ValueError, match="longer than the model's seq_len"):
        GPT(SMALL)(torch.zeros(1, 17, dtype=torch.long))
