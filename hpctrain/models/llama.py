"""A Llama-style decoder-only transformer: RMSNorm, rotary positions, a SwiGLU MLP, grouped-query
attention and optionally untied embeddings (Touvron et al. 2023; Llama 2 and 3's layout).

Laid out like :mod:`hpctrain.models.gpt`, so every strategy treats it the same way:

* blocks in an ``nn.ModuleList`` named ``blocks`` (FSDP units, activation checkpointing,
  pipeline stages); the top-level children before ``blocks`` (``tok_emb``) run before it, those
  after (``norm``, ``head``) after it, and ``forward`` skips a child set to None (a pipeline stage);
* bias-free ``nn.Linear`` projections ``q, k, v, o`` and ``gate, up, down``: the tensor-parallel
  plan is ``Colwise`` on ``q, k, v, gate, up`` and ``Rowwise`` on ``o, down``;
* heads come from ``view(B, T, -1, head_dim)``: under tensor parallelism a rank holds
  ``heads / tp`` query and ``kv_heads / tp`` key/value heads, and the same code runs on its shard;
* rotary angles are computed in ``forward`` from the sequence length (no buffers: nothing to
  materialize after meta init, nothing a strategy could cast or shard), so the model takes any
  length; ``seq_len`` sizes the data and the estimator's shape;
* :meth:`Llama.reset_parameters` re-draws every weight in a fixed order from the global RNG.

The parameter count is :class:`hpctrain.models.shape.TransformerShape`'s for the same shape
(``mlp=swiglu, positions=rotary, norm=rmsnorm, bias=none``): the estimator and the model agree
by construction, and tests/models/test_llama.py checks the built model against both it and a
hand count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hpctrain.config.model import ModelConfig
from hpctrain.models.attention import AttentionContext, attend, prepare, split_of
from hpctrain.models.gpt import INIT_STD, check_output, token_vocab
from hpctrain.models.moe import Experts, MoE, MoEShape, collect_aux_loss
from hpctrain.models.shape import TransformerShape, llama_ffn

ROPE_THETA = 10_000.0  # Llama 2's rotary base
NORM_EPS = 1e-5


@dataclass(frozen=True)
class LlamaShape:
    """The sizes of a :class:`Llama`; ``kv_heads`` None: one per query head, ``ffn_hidden`` None: Llama's rule."""

    vocab: int = 256
    seq_len: int = 128
    n_layers: int = 4
    hidden: int = 128
    heads: int = 4
    kv_heads: int | None = None
    ffn_hidden: int | None = None
    tie_weights: bool = True
    moe: MoEShape | None = None  # a mixture of experts in place of each block's MLP

    def __post_init__(self) -> None:
        for name in ("vocab", "seq_len", "n_layers", "hidden", "heads", "kv", "ffn"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Llama {name}={getattr(self, name)} must be > 0")
        if self.hidden % self.heads or self.heads % self.kv or self.head_dim % 2:
            raise ValueError(f"Llama hidden ({self.hidden}) must split into heads ({self.heads}) of an even width, "
                             f"and kv_heads ({self.kv}) must divide heads")

    @property
    def kv(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def ffn(self) -> int:
        return llama_ffn(self.hidden) if self.ffn_hidden is None else self.ffn_hidden

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def transformer(self) -> TransformerShape:
        """The same model as the estimator describes it (``hpctrain estimate``'s flags)."""
        return TransformerShape(layers=self.n_layers, hidden=self.hidden, heads=self.heads, seq_len=self.seq_len,
                                vocab=self.vocab, kv_heads=self.kv, ffn_hidden=self.ffn, mlp="swiglu",
                                tied=self.tie_weights, positions="rotary", norm="rmsnorm", bias="none",
                                dropout=False, experts=self.moe.experts if self.moe else 1,
                                top_k=self.moe.top_k if self.moe else 1,
                                shared_experts=1 if self.moe and self.moe.shared_expert else 0)

    @property
    def params(self) -> int:
        return self.transformer().params


def rotary_angles(length: int, head_dim: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position x frequency, ``(length, head_dim / 2)`` in fp32 (RoFormer's angles)."""
    return rotary_at(torch.arange(length, device=device), head_dim)


def rotary_at(positions: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin at ``positions`` ``(T,)`` or ``(B, T)`` (a context-parallel rank's chunks, positions
    within packed documents): ``(*positions.shape, head_dim / 2)`` in fp32."""
    inv_freq = ROPE_THETA ** (-torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    angles = positions.to(torch.float32)[..., None] * inv_freq
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``(B, heads, T, head_dim)`` by position: feature i pairs with i + head_dim/2 (the
    Hugging Face Llama layout, so its q/k weights load unpermuted), in fp32, back in x's dtype."""
    if cos.dim() == 3:  # per-sample positions (B, T, .): the same for every head
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    first, second = x.float().chunk(2, dim=-1)
    return torch.cat((first * cos - second * sin, first * sin + second * cos), dim=-1).type_as(x)


class Attention(nn.Module):
    """Causal grouped-query attention: ``kv_heads`` key/value heads, each shared by ``heads / kv_heads`` queries."""

    def __init__(self, s: LlamaShape) -> None:
        super().__init__()
        self.head_dim = s.head_dim
        kv_width = s.kv * s.head_dim
        self.q, self.o = nn.Linear(s.hidden, s.hidden, bias=False), nn.Linear(s.hidden, s.hidden, bias=False)
        self.k, self.v = nn.Linear(s.hidden, kv_width, bias=False), nn.Linear(s.hidden, kv_width, bias=False)

    def forward(self, x: torch.Tensor, ctx: AttentionContext | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: the local head counts, which tensor parallelism divides
        q, k, v = (proj(x).view(b, t, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        # positions 0..T-1, or a context-parallel rank's chunks', or restarting at each packed document
        cos, sin = rotary_angles(t, self.head_dim, q.device) if ctx is None else rotary_at(ctx.positions, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        # SDPA shares each K/V head with its group of query heads (no repeated copy in memory)
        y = attend(q, k, v, ctx)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))`` (Shazeer 2020)."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate, self.up = nn.Linear(hidden, ffn, bias=False), nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


def mlp(s: LlamaShape) -> nn.Module:
    """The block's MLP: SwiGLU, or a mixture of SwiGLU experts (hpctrain.models.moe) when ``s.moe``."""
    if s.moe is None:
        return SwiGLU(s.hidden, s.ffn)
    return MoE(s.hidden, s.ffn, s.moe, shared=SwiGLU(s.hidden, s.ffn) if s.moe.shared_expert else None)


class Block(nn.Module):
    """Pre-norm: ``x + attn(norm1(x))``, then ``x + mlp(norm2(x))``."""

    def __init__(self, s: LlamaShape) -> None:
        super().__init__()
        self.norm1, self.attn = nn.RMSNorm(s.hidden, eps=NORM_EPS), Attention(s)
        self.norm2, self.mlp = nn.RMSNorm(s.hidden, eps=NORM_EPS), mlp(s)

    def forward(self, x: torch.Tensor, attn: AttentionContext | None = None) -> torch.Tensor:
        # one positional input unless there is a context: tensor parallel's PrepareModuleInput
        # (sequence parallel) declares the attention's inputs, one layout per positional argument
        h = self.norm1(x)
        x = x + (self.attn(h) if attn is None else self.attn(h, attn))
        return x + self.mlp(self.norm2(x))


class Llama(nn.Module):
    """int64 tokens ``(B, T)`` -> logits ``(B, T, vocab)``."""

    # parallel.tp also splits the embedding and the output by vocabulary rows (hpctrain.parallel.tensor)
    vocab_parallel = True

    def __init__(self, shape: LlamaShape | None = None) -> None:
        super().__init__()
        self.shape = s = shape or LlamaShape()
        # the layers' default inits must not consume the global RNG (see GPT.__init__)
        with torch.random.fork_rng(devices=[]):
            self.tok_emb = nn.Embedding(s.vocab, s.hidden)
            self.blocks = nn.ModuleList(Block(s) for _ in range(s.n_layers))
            self.norm = nn.RMSNorm(s.hidden, eps=NORM_EPS)
            self.head = nn.Linear(s.hidden, s.vocab, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """In a fixed order from the global RNG: N(0, 0.02) weights, the residual projections
        (``o``, ``down``) scaled by 1/sqrt(2 n_layers), unit norms; re-ties the head."""
        if self.shape.tie_weights:  # (again: to_empty() unties shared parameters)
            self.head.weight = self.tok_emb.weight
        residual_std = INIT_STD / math.sqrt(2 * self.shape.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, nn.RMSNorm):
                nn.init.ones_(module.weight)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, 0.0, INIT_STD)
            elif isinstance(module, Experts):  # w_down is a residual projection, like down
                module.reset_parameters(INIT_STD, residual_std)
            elif isinstance(module, nn.Linear) and not (module is self.head and self.shape.tie_weights):
                nn.init.normal_(module.weight, 0.0, residual_std if name.endswith((".o", ".down")) else INIT_STD)

    def forward(self, tokens: torch.Tensor, doc_ids: torch.Tensor | None = None
                ) -> torch.Tensor | dict[str, torch.Tensor]:
        """Tokens -> logits; a pipeline stage without the embedding takes hidden states, one
        without the head returns them (hpctrain.parallel.pipeline). A mixture of experts in
        training returns ``{"logits", "aux_loss"}`` (the hook the task adds: hpctrain.models.moe).
        ``doc_ids`` (B, T): packed documents, attended and positioned each on its own; under
        context parallel, the logits of this rank's chunks (hpctrain.models.attention)."""
        ctx = None
        if self.tok_emb is not None:
            tokens, ctx = prepare(tokens, doc_ids, split_of(self))
        elif doc_ids is not None:  # a later pipeline stage: hidden states in, the documents' context from their ids
            ctx = prepare(doc_ids, doc_ids)[1]
        x = tokens if self.tok_emb is None else self.tok_emb(tokens)
        for block in self.blocks:
            # the context as a keyword only when there is one: a plain forward calls blocks as before
            x = block(x) if ctx is None else block(x, attn=ctx)
        if self.norm is not None:
            x = self.norm(x)
        out = x if self.head is None else self.head(x)
        aux = collect_aux_loss(self) if self.shape.moe is not None and self.training else None
        return out if aux is None else {"logits": out, "aux_loss": aux}


def build_llama(num_classes: int = 256, *, config: ModelConfig | None = None,
                input_shape: tuple[int, ...] | None = None, input_dtype: torch.dtype = torch.long,
                name: str = "llama") -> Llama:
    """A Llama sized by the ``model`` config section (the vocabulary: ``model.vocab`` or the
    data's); with ``input_shape`` one forward pass on int64 zeros checks it against the data."""
    cfg = config or ModelConfig(name=name)
    vocab = token_vocab(cfg, num_classes, input_shape, input_dtype, name)
    model = Llama(LlamaShape(vocab=vocab, seq_len=cfg.seq_len, n_layers=cfg.n_layers, hidden=cfg.hidden,
                             heads=cfg.heads, kv_heads=cfg.kv_heads, ffn_hidden=cfg.ffn_hidden,
                             tie_weights=cfg.tie_weights, moe=moe_shape(cfg)))
    if input_shape is not None:
        check_output(model, name, input_shape[0], vocab)
    return model


def moe_shape(cfg: ModelConfig) -> MoEShape | None:
    """The ``model.experts`` keys as a :class:`MoEShape`; None for a dense MLP (``model.experts=0``)."""
    if not cfg.experts:
        return None
    return MoEShape(experts=cfg.experts, top_k=cfg.top_k, aux_loss_coef=cfg.aux_loss_coef,
                    capacity_factor=cfg.capacity_factor, shared_expert=cfg.shared_expert)
