"""The shape of a decoder-only transformer (:class:`TransformerShape`): its parameter count by
formula, and how pipeline stages split its blocks. A model family describes itself with one
(:attr:`hpctrain.models.family.ModelFamily.shape`); the estimator, the planner and the pipeline
split read it. A component (no torch at import), so models and the estimator share it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hpctrain.core.errors import UserError

if TYPE_CHECKING:
    from torch import nn


MLPS = ("gelu", "swiglu")  # two matrices (up, down) or three (gate, up, down)
POSITIONS = ("learned", "rotary", "alibi")  # only learned positions are parameters
NORMS = ("layernorm", "rmsnorm")  # weight and bias, or a weight alone
BIASES = ("all", "qkv", "none")  # biases on every linear layer (GPT-2), on q, k, v only (Qwen2), on none (Llama)


def llama_ffn(hidden: int, multiple: int = 256) -> int:
    """Llama's SwiGLU width: 2/3 of 4h (the same weights as a 4h two-matrix MLP), rounded up
    to a multiple of 256 (h = 4096 gives 11008, Llama 2 7B's)."""
    return multiple * -(-int(8 * hidden / 3) // multiple)


@dataclass(frozen=True)
class TransformerShape:
    """A decoder-only transformer: ``layers`` blocks of width ``hidden``, ``heads`` attention heads.

    The defaults are GPT-2's (the paper formulas' model): per block 12h^2 + 13h (QKV 3h^2+3h,
    projection h^2+h, MLP 4h^2+4h and 4h^2+h, two layer norms 4h), plus V*h token and s*h
    position embeddings (tied output), and the final layer norm (2h). Today's models differ
    in ways that change the count: grouped-query attention (``kv_heads`` < ``heads`` shrinks
    K and V), a SwiGLU MLP of any width (three matrices), untied output embeddings, rotary or
    ALiBi positions (no parameters), RMSNorm (no bias), fewer biases, and a mixture of
    ``experts`` MLPs of which each token uses ``top_k``.
    """

    layers: int
    hidden: int
    heads: int
    seq_len: int
    vocab: int
    kv_heads: int | None = None  # None: as many as query heads (multi-head attention)
    ffn_hidden: int | None = None  # None: 4h for gelu, Llama's rounding of 8h/3 for swiglu
    mlp: str = "gelu"
    tied: bool = True
    positions: str = "learned"
    max_positions: int | None = None  # rows of a learned position table; None: seq_len
    norm: str = "layernorm"
    bias: str = "all"
    experts: int = 1
    top_k: int = 1
    dropout: bool = True  # Korthikanti's dropout masks; today's LLMs train without
    head_dim: int | None = None  # None: hidden / heads; set when the heads are narrower (Mistral NeMo: 128, not 160)

    def __post_init__(self) -> None:
        if self.heads <= 0:  # first: the head width below divides by it
            raise UserError(f"--heads must be a positive integer, got {self.heads}")
        for flag, value in (("--layers", self.layers), ("--hidden", self.hidden),
                            ("--seq-len", self.seq_len), ("--vocab", self.vocab), ("--kv-heads", self.kv),
                            ("--ffn-hidden", self.ffn), ("--experts", self.experts), ("--top-k", self.top_k),
                            ("--head-dim", self.head_size)):
            if value <= 0:
                raise UserError(f"{flag} must be a positive integer, got {value}")
        if self.head_dim is None and self.hidden % self.heads:
            raise UserError(f"--hidden ({self.hidden}) must be divisible by --heads ({self.heads})")
        if self.heads % self.kv:
            raise UserError(f"--kv-heads ({self.kv}) must divide --heads ({self.heads}): each K/V head "
                            "serves a whole group of query heads")
        if self.top_k > self.experts:
            raise UserError(f"--top-k ({self.top_k}) cannot exceed --experts ({self.experts})")
        for option, choice, allowed in (("--mlp", self.mlp, MLPS), ("--positions", self.positions, POSITIONS),
                                        ("--norm", self.norm, NORMS), ("--bias", self.bias, BIASES)):
            if choice not in allowed:
                raise UserError(f"{option} {choice!r} is not one of {', '.join(allowed)}")

    @property
    def kv(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def head_size(self) -> int:
        """One head's width: ``head_dim`` when given, else hidden / heads."""
        return self.hidden // self.heads if self.head_dim is None else self.head_dim

    @property
    def q_dim(self) -> int:
        """Width of Q and of the attention output: heads x head dimension (the hidden size unless
        ``head_dim`` says otherwise)."""
        return self.heads * self.head_size

    @property
    def kv_dim(self) -> int:
        """Width of K (and of V): kv heads x head dimension."""
        return self.kv * self.head_size

    @property
    def ffn(self) -> int:
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        return llama_ffn(self.hidden) if self.mlp == "swiglu" else 4 * self.hidden

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.mlp == "swiglu" else 2

    @property
    def attention_params(self) -> int:
        h, q, kv = self.hidden, self.q_dim, self.kv_dim
        biases = {"all": q + 2 * kv + h, "qkv": q + 2 * kv, "none": 0}[self.bias]
        return 2 * h * q + 2 * h * kv + biases  # Q and the output projection h x q, K and V h x kv

    @property
    def expert_params(self) -> int:
        """One MLP (one expert of a mixture)."""
        biases = (self.mlp_matrices - 1) * self.ffn + self.hidden if self.bias == "all" else 0
        return self.mlp_matrices * self.hidden * self.ffn + biases

    @property
    def router_params(self) -> int:
        return self.hidden * self.experts if self.experts > 1 else 0

    @property
    def norm_params(self) -> int:
        return self.hidden * (2 if self.norm == "layernorm" else 1)

    @property
    def dense_layer_params(self) -> int:
        """What every token uses in a block: attention, router, two norms (no experts)."""
        return self.attention_params + self.router_params + 2 * self.norm_params

    @property
    def layer_params(self) -> int:
        return self.dense_layer_params + self.experts * self.expert_params

    @property
    def active_layer_params(self) -> int:
        return self.dense_layer_params + self.top_k * self.expert_params

    @property
    def embedding_params(self) -> int:
        """Input side: token embedding and a learned position table."""
        rows = self.max_positions or self.seq_len
        return (self.vocab + (rows if self.positions == "learned" else 0)) * self.hidden

    @property
    def head_params(self) -> int:
        """Output side: the final norm and, untied, the output projection."""
        return self.norm_params + (0 if self.tied else self.vocab * self.hidden)

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.embedding_params + self.head_params

    @property
    def active_params(self) -> int:
        """Parameters one token uses: the total less the experts it is not routed to."""
        return self.layers * self.active_layer_params + self.embedding_params + self.head_params

    @property
    def lookup_params(self) -> int:
        """Parameters a token reads but does not multiply by: the input tables (token embedding,
        learned positions), unless the output layer multiplies by the tied token embedding."""
        return self.embedding_params - (self.vocab * self.hidden if self.tied else 0)

    @property
    def expert_total(self) -> int:
        """Parameters in expert MLPs (split further by expert parallelism); 0 for a dense model."""
        return self.layers * self.experts * self.expert_params if self.experts > 1 else 0


def stage_layers(layers: int, pp: int) -> list[int]:
    """Blocks per pipeline stage, as even as possible. A remainder goes to the middle stages
    first, since the first holds the embedding and the last the output layer: Llama 3 405B's
    126 blocks on 16 stages are 7, 8 x 14, 7 (Dubey et al. 2024)."""
    if pp > layers:
        raise UserError(f"--pp {pp} exceeds the {layers} layers: a pipeline stage needs at least one layer")
    base, extra = divmod(layers, pp)
    order = list(range(1, pp - 1)) + [pp - 1, 0] if pp > 1 else [0]
    counts = [base] * pp
    for stage in order[:extra]:
        counts[stage] += 1
    return counts


def stage_params(shape: TransformerShape, pp: int) -> list[int]:
    """Parameters held by each pipeline stage: its blocks, the embedding on the first, the
    output layer on the last. Tied embeddings keep a second copy on the last stage (Megatron's
    way: the output projection needs the weight and its gradient is all-reduced between the two)."""
    counts = stage_layers(shape.layers, pp)
    held = [n * shape.layer_params for n in counts]
    held[0] += shape.embedding_params
    held[-1] += shape.head_params + (shape.vocab * shape.hidden if shape.tied and pp > 1 else 0)
    return held


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
