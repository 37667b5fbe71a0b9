"""The registered Llama-style model: its parameter count is the estimator's, its FLOPs counted by
torch equal the estimator's, grouped-query attention equals repeated K/V heads, causal, seeded
init independent of how it was built, compiled blocks give eager's gradients, and the keys and
parallel layouts it cannot take fail before start (exit 2) naming them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from hpctrain.config import ConfigError, load_config
from hpctrain.core.env import ClusterEnv
from hpctrain.core.errors import UserError
from hpctrain.estimate import flops
from hpctrain.models import build_model, count_parameters
from hpctrain.models.llama import Llama, LlamaShape, apply_rotary, rotary_angles
from hpctrain.models.shape import stage_layers
from hpctrain.parallel.pipeline import split_blocks
from hpctrain.planning.layout import make_layout

SMALL = LlamaShape(vocab=64, seq_len=16, n_layers=2, hidden=32, heads=4, kv_heads=2, ffn_hidden=48)


def _hand_count(s: LlamaShape) -> int:
    head_dim = s.hidden // s.heads
    attention = 2 * s.hidden * s.hidden + 2 * s.hidden * s.kv * head_dim  # q, o; k, v (no biases)
    mlp = 3 * s.hidden * s.ffn  # gate, up, down
    norms = 2 * s.hidden  # two RMSNorm weights
    head = 0 if s.tie_weights else s.vocab * s.hidden
    return s.n_layers * (attention + mlp + norms) + s.vocab * s.hidden + s.hidden + head


@pytest.mark.parametrize("shape", [LlamaShape(), SMALL, LlamaShape(hidden=96, heads=6, kv_heads=1, tie_weights=False)])
def test_parameter_count_is_the_hand_count_and_the_estimators(shape: LlamaShape) -> None:
    model = Llama(shape)
    assert count_parameters(model) == _hand_count(shape) == shape.transformer().params
    assert (model.head.weight is model.tok_emb.weight) is shape.tie_weights
    assert LlamaShape().ffn == 512  # Llama's 8h/3 rounded up to 256 (the estimator's llama_ffn)


def test_sizes_come_from_the_model_config() -> None:
    cfg = load_config(None, ["model.name=llama", "model.n_layers=3", "model.hidden=64", "model.heads=8",
                             "model.kv_heads=2", "model.ffn_hidden=96", "model.seq_len=32", "model.tie_weights=false"])
    model = build_model("llama", 256, input_shape=(32,), input_dtype=torch.long, config=cfg.model)
    assert isinstance(model, Llama) and len(model.blocks) == 3
    assert model.blocks[0].attn.k.out_features == 2 * 8 and model.blocks[0].mlp.up.out_features == 96
    assert count_parameters(model) == _hand_count(model.shape)
    assert model(torch.randint(0, 256, (2, 32))).shape == (2, 32, 256)


@pytest.mark.parametrize("tied", [True, False])
def test_flops_counted_by_torch_equal_the_estimators(tied: bool) -> None:
    """FlopCounterMode over one forward+backward on the meta device (SDPA's math path, counted
    as its matmuls; no memory used) against ``hpctrain estimate``'s model FLOPs for the same
    shape: 6 x the parameters a token multiplies by + attention's 12 L h s per token. Untied, the
    input embedding is a lookup with no multiply; tied, the output layer multiplies by it."""
    shape = LlamaShape(vocab=256, seq_len=128, n_layers=4, hidden=128, heads=4, kv_heads=2, tie_weights=tied)
    with torch.device("meta"):
        model = Llama(shape)
        tokens = torch.zeros((2, shape.seq_len), dtype=torch.long)
    with FlopCounterMode(display=False) as counter:
        model(tokens).sum().backward()
    counted = counter.get_total_flops() / tokens.numel()
    estimated = flops.model_flops(shape.transformer(), 1)
    assert counted == pytest.approx(estimated, rel=0.02)
    norms = 6 * (2 * shape.n_layers + 1) * shape.hidden  # element-wise: no matmul FLOPs either
    assert counted == estimated - norms  # exactly


def test_grouped_query_attention_equals_repeated_key_value_heads() -> None:
    torch.manual_seed(0)
    attn = Llama(SMALL).blocks[0].attn
    x = torch.randn(2, 16, 32)
    b, t, d = 2, 16, attn.head_dim
    q, k, v = (proj(x).view(b, t, -1, d).transpose(1, 2) for proj in (attn.q, attn.k, attn.v))
    cos, sin = rotary_angles(t, d, x.device)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)  # each K/V head serves 2 queries
    want = attn.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1))
    torch.testing.assert_close(attn(x), want)


def test_rotary_scores_depend_on_the_relative_position_only() -> None:
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)
    cos, sin = rotary_angles(12, 8, torch.device("cpu"))

    def score(i: int, j: int) -> torch.Tensor:
        return (apply_rotary(q, cos[i], sin[i]) * apply_rotary(k, cos[j], sin[j])).sum()

    torch.testing.assert_close(score(3, 1), score(10, 8))
    assert not torch.allclose(score(3, 1), score(3, 2))


def test_changing_a_later_token_never_changes_earlier_logits() -> None:
    torch.manual_seed(0)
    model = Llama(SMALL).eval()
    tokens = torch.randint(0, 64, (2, 16))
    base = model(tokens)
    changed = tokens.clone()
    changed[:, 9] = (changed[:, 9] + 1) % 64
    out = model(changed)
    assert torch.equal(out[:, :9], base[:, :9]) and not torch.allclose(out[:, 9], base[:, 9])


def test_init_from_the_seed_is_the_same_built_eagerly_or_on_meta() -> None:
    torch.manual_seed(3)
    eager = Llama(SMALL)
    with torch.device("meta"):
        late = Llama(SMALL)
    late.to_empty(device="cpu")
    torch.manual_seed(3)
    late.reset_parameters()
    for (name, a), b in zip(eager.state_dict().items(), late.state_dict().values()):
        assert torch.equal(a, b), name
    assert late.head.weight is late.tok_emb.weight  # re-tied after to_empty


@pytest.mark.slow
def test_compiled_blocks_give_eagers_gradients() -> None:
    """train.compile compiles block by block (FSDP's units): rotary angles, GQA and SwiGLU trace."""
    shape = LlamaShape(vocab=64, seq_len=16, n_layers=1, hidden=32, heads=4, kv_heads=2, ffn_hidden=64,
                       tie_weights=False)
    torch.manual_seed(0)
    eager = Llama(shape)
    torch.manual_seed(0)
    compiled = Llama(shape)
    for block in compiled.blocks:
        block.compile()
    tokens = torch.randint(0, 64, (2, 16))
    for model in (eager, compiled):
        model(tokens).square().mean().backward()
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=name)


def test_pipeline_stages_may_be_uneven_as_the_estimator_sizes_them() -> None:
    """5 blocks on 2 stages are 2 + 3: the remainder goes to the middle stages, then the last
    (the first holds the embedding and the most 1F1B micro-batches), as ``hpctrain estimate``."""
    for blocks, stages in ((5, 2), (3, 2), (126, 16), (7, 4), (4, 4)):
        split = split_blocks(blocks, stages)
        assert [len(r) for r in split] == stage_layers(blocks, stages)
        assert [i for r in split for i in r] == list(range(blocks))
    with pytest.raises(ValueError, match="3 blocks cannot fill 4 stages"):
        split_blocks(3, 4)


LLAMA = ["model.name=llama", "model.n_layers=3", "model.hidden=32", "model.heads=4", "model.kv_heads=2",
         "model.seq_len=32", "model.tie_weights=false", "data.name=shards", "data.path=unused"]


def test_what_llama_cannot_take_fails_before_start_naming_the_key() -> None:
    four = ClusterEnv(world_size=4, local_world_size=4)
    make_layout(load_config(None, [*LLAMA, "parallel.tp=2", "parallel.strategy=fsdp"]), four)  # dp2 x tp2
    make_layout(load_config(None, [*LLAMA, "parallel.pp=2", "parallel.strategy=fsdp"]), four)  # 3 blocks: 2 stages
    with pytest.raises(ConfigError, match=r"2 key/value heads \(model.kv_heads\), not divisible by tp=4") as err:
        make_layout(load_config(None, [*LLAMA, "parallel.tp=4"]), four)
    assert isinstance(err.value, UserError) and "hint: a parallel.tp that divides" in str(err.value)
    with pytest.raises(ConfigError, match=r"parallel.pp=4 makes 4 pipeline stages, more than model.n_layers=3"):
        make_layout(load_config(None, [*LLAMA, "parallel.pp=4"]), four)
    with pytest.raises(ConfigError, match="hint: model.tie_weights=false"):
        make_layout(load_config(None, [*LLAMA, "model.tie_weights=true", "parallel.pp=2", "parallel.strategy=fsdp"]),
                  four)
    for keys, message in ((["model.kv_heads=3"], r"model.kv_heads \(3\) must divide model.heads \(4\).*kv_heads=2"),
                          (["model.hidden=12", "model.heads=4"], "must be even"),
                          (["model.dropout=0.1"], "llama trains without dropout")):
        with pytest.raises(ConfigError, match=message):
            load_config(None, [*LLAMA, *keys])
    with pytest.raises(ConfigError, match="model.kv_heads applies to model.name=llama only"):
        load_config(None, ["model.name=gpt", "model.kv_heads=2"])
