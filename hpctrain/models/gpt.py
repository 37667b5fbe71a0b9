"""A small decoder-only transformer (GPT-2 style): the language-model workload.

Shaped for the sharding strategies that come after it:

* pre-LN blocks in an ``nn.ModuleList`` named ``blocks``: FSDP wraps one block at a time;
* attention and MLP projections are separate ``nn.Linear`` layers named ``q, k, v, o`` and
  ``up, down``: a tensor-parallel plan is ``Colwise`` on ``q, k, v, up`` and ``Rowwise`` on
  ``o, down``;
* heads come from ``view(B, T, -1, head_dim)``, never from a head count: under tensor
  parallelism a rank holds ``heads / tp`` heads and the same code runs on its shard;
* :meth:`GPT.reset_parameters` re-draws every weight in a fixed order from the global RNG,
  so a seed gives the same model however it was built (eagerly, or on ``meta`` then
  ``to_empty``).

Parameter count with tied embeddings (the convention of :mod:`hpctrain.models.shape`):
per block ``12 h^2 + 13 h``, plus ``(V + T) h`` embeddings and ``2 h`` for the final layer
norm; untied weights add ``V h`` for the output projection (no bias). Without biases
(``bias=False``, nanoGPT's option: no linear nor layer-norm biases) a block has ``12 h^2 + 2 h``
and the final layer norm ``h``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hpctrain.config.model import ModelConfig
from hpctrain.models.attention import AttentionContext, attend, prepare, split_of
from hpctrain.models.user import ModelError

INIT_STD = 0.02  # GPT-2's initializer range


@dataclass(frozen=True)
class GPTShape:
    """The sizes of a :class:`GPT`; ``seq_len`` is the longest context (learned positions)."""

    vocab: int = 256
    seq_len: int = 128
    n_layers: int = 4
    hidden: int = 128
    heads: int = 4
    tie_weights: bool = True
    dropout: float = 0.0
    bias: bool = True  # biases in the linear layers and layer norms (GPT-2); False: none (nanoGPT's bias=False)

    def __post_init__(self) -> None:
        for name in ("vocab", "seq_len", "n_layers", "hidden", "heads"):
            if getattr(self, name) <= 0:
                raise ValueError(f"GPT {name}={getattr(self, name)} must be > 0")
        if self.hidden % self.heads:
            raise ValueError(f"GPT hidden ({self.hidden}) must be divisible by heads ({self.heads})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPT dropout ({self.dropout}) must be in [0, 1)")

    @property
    def params(self) -> int:
        """The parameter count by formula (tests check the built model against it)."""
        h = self.hidden
        head = 0 if self.tie_weights else self.vocab * h
        per_block, final_norm = (12 * h * h + 13 * h, 2 * h) if self.bias else (12 * h * h + 2 * h, h)
        return self.n_layers * per_block + (self.vocab + self.seq_len) * h + final_norm + head


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, dropout: float, bias: bool = True) -> None:
        super().__init__()
        self.head_dim, self.dropout = hidden // heads, dropout
        self.q, self.k, self.v = (nn.Linear(hidden, hidden, bias=bias) for _ in range(3))
        self.o = nn.Linear(hidden, hidden, bias=bias)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, ctx: AttentionContext | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: the local head count, which tensor parallelism divides
        q, k, v = (proj(x).view(b, t, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        # documents and context parallel: hpctrain.models.attention (plain causal SDPA without them)
        y = attend(q, k, v, ctx, dropout_p=self.dropout if self.training else 0.0)
        return self.resid_drop(self.o(y.transpose(1, 2).reshape(b, t, -1)))


class MLP(nn.Module):
    def __init__(self, hidden: int, dropout: float, bias: bool = True) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(hidden, 4 * hidden, bias=bias), nn.Linear(4 * hidden, hidden, bias=bias)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.down(F.gelu(self.up(x))))


class Block(nn.Module):
    """Pre-LN: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

    def __init__(self, hidden: int, heads: int, dropout: float, bias: bool = True) -> None:
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(hidden, bias=bias), Attention(hidden, heads, dropout, bias)
        self.ln2, self.mlp = nn.LayerNorm(hidden, bias=bias), MLP(hidden, dropout, bias)

    def forward(self, x: torch.Tensor, attn: AttentionContext | None = None) -> torch.Tensor:
        # one positional input unless there is a context: tensor parallel's PrepareModuleInput
        # (sequence parallel) declares the attention's inputs, one layout per positional argument
        h = self.ln1(x)
        x = x + (self.attn(h) if attn is None else self.attn(h, attn))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """int64 tokens ``(B, T)`` with ``T <= shape.seq_len`` -> logits ``(B, T, vocab)``."""

    def __init__(self, shape: GPTShape | None = None) -> None:
        super().__init__()
        self.shape = s = shape or GPTShape()
        # The layers' own default inits must not consume the global RNG: then a seed gives the
        # same weights built eagerly or on meta + to_empty + reset_parameters (FSDP's path).
        with torch.random.fork_rng(devices=[]):
            self.tok_emb = nn.Embedding(s.vocab, s.hidden)
            self.pos_emb = nn.Embedding(s.seq_len, s.hidden)
            self.drop = nn.Dropout(s.dropout)
            self.blocks = nn.ModuleList(Block(s.hidden, s.heads, s.dropout, s.bias) for _ in range(s.n_layers))
            self.ln_f = nn.LayerNorm(s.hidden, bias=s.bias)
            self.head = nn.Linear(s.hidden, s.vocab, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2's init, in a fixed order from the global RNG: N(0, 0.02) weights, zero biases,
        unit layer norms, and the residual projections (``o``, ``down``) scaled by
        1/sqrt(2 n_layers) so the residual stream's variance does not grow with depth."""
        if self.shape.tie_weights:  # (again: to_empty() unties shared parameters)
            self.head.weight = self.tok_emb.weight
        residual_std = INIT_STD / math.sqrt(2 * self.shape.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                if module.bias is not None:  # bias=False: none
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, 0.0, INIT_STD)
            elif isinstance(module, nn.Linear) and not (module is self.head and self.shape.tie_weights):
                std = residual_std if name.endswith((".o", ".down")) else INIT_STD
                nn.init.normal_(module.weight, 0.0, std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Tokens -> logits. A pipeline stage (hpctrain.parallel.pipeline) sets the top-level
        parts it does not hold to None: a later stage takes hidden states instead of tokens,
        an earlier one returns hidden states instead of logits. ``doc_ids`` (B, T): packed
        documents, attended and positioned each on its own (hpctrain.models.attention). Under
        context parallel the logits are those of this rank's chunks of the sequence."""
        x, ctx = (tokens, None) if self.tok_emb is None else self._embed(tokens, doc_ids)
        if self.tok_emb is None and doc_ids is not None:  # a later pipeline stage: the context from the ids
            ctx = prepare(doc_ids, doc_ids)[1]
        for block in self.blocks:
            # the context as a keyword only when there is one: a plain forward calls blocks as before
            x = block(x) if ctx is None else block(x, attn=ctx)
        if self.ln_f is not None:
            x = self.ln_f(x)
        return x if self.head is None else self.head(x)

    def _embed(self, tokens: torch.Tensor, doc_ids: torch.Tensor | None
               ) -> tuple[torch.Tensor, AttentionContext | None]:
        t = tokens.shape[1]
        if t > self.shape.seq_len:
            raise ValueError(f"a sequence of {t} tokens is longer than the model's seq_len ({self.shape.seq_len}); "
                             "hint: raise model.seq_len or shard the text with a shorter --seq-len")
        tokens, ctx = prepare(tokens, doc_ids, split_of(self))  # this rank's tokens, their positions
        positions = torch.arange(t, device=tokens.device) if ctx is None else ctx.positions
        return self.drop(self.tok_emb(tokens) + self.pos_emb(positions)), ctx


def build_gpt(num_classes: int = 256, *, config: ModelConfig | None = None,
              input_shape: tuple[int, ...] | None = None, input_dtype: torch.dtype = torch.long,
              name: str = "gpt") -> GPT:
    """A GPT sized by the ``model`` config section; the vocabulary is ``model.vocab`` or the
    data's (``num_classes``). With ``input_shape`` (``(seq_len,)`` of the data), one forward
    pass on int64 zeros checks the sizes against the data before training starts."""
    cfg = config or ModelConfig(name=name)
    vocab = token_vocab(cfg, num_classes, input_shape, input_dtype, name)
    model = GPT(GPTShape(vocab=vocab, seq_len=cfg.seq_len, n_layers=cfg.n_layers, hidden=cfg.hidden,
                         heads=cfg.heads, tie_weights=cfg.tie_weights, dropout=cfg.dropout, bias=cfg.bias))
    if input_shape is not None:
        check_output(model, name, input_shape[0], vocab)
    return model


def token_vocab(cfg: ModelConfig, num_classes: int, input_shape: tuple[int, ...] | None,
                input_dtype: torch.dtype, name: str) -> int:
    """The vocabulary of a token model (``model.vocab`` or the data's), after checking that the
    data are token ids no longer than ``model.seq_len``: a ModelError names the key otherwise."""
    vocab = cfg.vocab or num_classes
    if vocab < num_classes:
        raise ModelError(f"model.vocab={vocab} is smaller than the data's vocabulary ({num_classes}); "
                         "hint: leave model.vocab unset to take the data's")
    if input_shape is not None and (len(input_shape) != 1 or input_dtype.is_floating_point):
        raise ModelError(f"model.name={name!r} reads token ids (int64, shape (seq_len,)); the data gives "
                         f"{input_dtype} samples of shape {tuple(input_shape)}; hint: data.name=shakespeare, "
                         "or text shards from `hpctrain data shard text:PATH DIR`")
    if input_shape is not None and input_shape[0] > cfg.seq_len:
        raise ModelError(f"model.name={name!r} takes token sequences of at most model.seq_len={cfg.seq_len}, the "
                         f"data's samples have shape {tuple(input_shape)}; hint: model.seq_len={input_shape[-1]}, "
                         "or shard the text with a shorter --seq-len")
    return vocab


def check_output(model: nn.Module, name: str, seq_len: int, vocab: int) -> None:
    """Eval mode, no grad, RNG untouched: the check changes nothing of the run that follows."""
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        model.eval()
        out = model(torch.zeros((2, seq_len), dtype=torch.long))
        model.train()
    if tuple(out.shape) != (2, seq_len, vocab):
        raise ModelError(f"model.name={name!r} returned shape {tuple(out.shape)}, expected {(2, seq_len, vocab)}")
