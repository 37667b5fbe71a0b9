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
    # multi-head latent attention (DeepSeek-V2/V3; 0: ordinary attention): K and V are up-projected from a
    # kv_lora_rank latent, Q from a q_lora_rank one (0: straight from the hidden state); each query/key head is
    # head_dim (the "nope" part) + qk_rope_dim wide, each value head v_head_dim (None: head_dim)
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int | None = None
    # a mixture's leading dense blocks (DeepSeek-V3's first_k_dense_replace: 3), each one MLP of dense_ffn
    # (None: ffn); shared_experts: MLPs of width ffn every token passes through besides its top_k
    dense_layers: int = 0
    dense_ffn: int | None = None
    shared_experts: int = 0
    qk_norm: bool = False  # a norm of head width on each query and key head (Qwen3)
    block_norms: int = 2  # norms per block: pre-attention and pre-MLP; Gemma 2 adds a post-norm to each (4)
    # local attention: local_layers of the blocks attend to the last sliding_window tokens only (Gemma 2: every
    # other block, 4,096): their score/value FLOPs are counted over min(seq_len, window)
    sliding_window: int | None = None
    local_layers: int = 0

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
        self._check_extensions()
        for option, choice, allowed in (("--mlp", self.mlp, MLPS), ("--positions", self.positions, POSITIONS),
                                        ("--norm", self.norm, NORMS), ("--bias", self.bias, BIASES)):
            if choice not in allowed:
                raise UserError(f"{option} {choice!r} is not one of {', '.join(allowed)}")

    def _check_extensions(self) -> None:
        """The fields of today's configs (MLA, dense leading blocks, shared experts, local attention)."""
        for name in ("kv_lora_rank", "q_lora_rank", "qk_rope_dim", "dense_layers", "shared_experts", "local_layers"):
            if getattr(self, name) < 0:
                raise UserError(f"{name} must be a non-negative integer, got {getattr(self, name)}")
        for name in ("v_head_dim", "dense_ffn", "sliding_window"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise UserError(f"{name} must be a positive integer, got {value}")
        if self.dense_layers > self.layers or self.local_layers > self.layers:
            raise UserError(f"dense_layers ({self.dense_layers}) and local_layers ({self.local_layers}) cannot "
                            f"exceed the {self.layers} layers")
        if (self.q_lora_rank or self.qk_rope_dim or self.v_head_dim) and not self.kv_lora_rank:
            raise UserError("q_lora_rank, qk_rope_dim and v_head_dim describe multi-head latent attention: give "
                            "kv_lora_rank too")
        if self.block_norms < 1:
            raise UserError(f"block_norms must be at least 1, got {self.block_norms}")

    @property
    def mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V2/V3)."""
        return self.kv_lora_rank > 0

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
    def qk_dim(self) -> int:
        """Width of the query-key products: heads x (head_dim + the rotary part): MLA's 128 x 192 = 24,576;
        otherwise ``q_dim``."""
        return self.heads * (self.head_size + self.qk_rope_dim)

    @property
    def v_dim(self) -> int:
        """Width of the attention-value products and of the output projection's input: heads x value
        head (MLA's 128 x 128 = 16,384; otherwise ``q_dim``)."""
        return self.heads * (self.v_head_dim or self.head_size)

    @property
    def attention_widths(self) -> tuple[int, int, int, int]:
        """(Q, K, V, output-projection input) widths one token's attention saves for backward: K and V
        kv_dim wide under grouped-query attention, MLA's up-projected per-head K and V."""
        if self.mla:
            return self.qk_dim, self.qk_dim, self.v_dim, self.v_dim
        return self.q_dim, self.kv_dim, self.kv_dim, self.q_dim

    @property
    def mla_latent(self) -> int:
        """MLA: the latents one token's attention also saves (the compressed query and key/value, the
        shared rotary key); 0 otherwise."""
        return self.q_lora_rank + self.kv_lora_rank + self.qk_rope_dim if self.mla else 0

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
        if self.mla:
            return self._mla_params
        h, q, kv = self.hidden, self.q_dim, self.kv_dim
        biases = {"all": q + 2 * kv + h, "qkv": q + 2 * kv, "none": 0}[self.bias]
        qk_norms = 2 * self.head_size * (2 if self.norm == "layernorm" else 1) if self.qk_norm else 0
        return 2 * h * q + 2 * h * kv + biases + qk_norms  # Q and the output projection h x q, K and V h x kv

    @property
    def _mla_params(self) -> int:
        """DeepSeek-V3's attention: Q from its latent (h x q_lora, a norm, q_lora x heads·qk) or straight
        (h x heads·qk); the key/value latent and the shared rotary key (h x (kv_lora + rope)), a norm,
        their up-projection (kv_lora x heads·(nope + v)); the output projection heads·v x h. No biases."""
        h, per_norm = self.hidden, 2 if self.norm == "layernorm" else 1
        lora_q = self.q_lora_rank
        q = h * lora_q + per_norm * lora_q + lora_q * self.qk_dim if lora_q else h * self.qk_dim
        kv = h * (self.kv_lora_rank + self.qk_rope_dim) + per_norm * self.kv_lora_rank + \
            self.kv_lora_rank * (self.q_dim + self.v_dim)
        return q + kv + self.v_dim * h

    def mlp_params(self, width: int) -> int:
        """One MLP of ``width`` (biases when every linear layer has them)."""
        biases = (self.mlp_matrices - 1) * width + self.hidden if self.bias == "all" else 0
        return self.mlp_matrices * self.hidden * width + biases

    @property
    def expert_params(self) -> int:
        """One MLP (one expert of a mixture)."""
        return self.mlp_params(self.ffn)

    @property
    def router_params(self) -> int:
        return self.hidden * self.experts if self.experts > 1 else 0

    @property
    def norm_params(self) -> int:
        return self.hidden * (2 if self.norm == "layernorm" else 1)

    @property
    def dense_layer_params(self) -> int:
        """What every token uses in a block: attention, router, its norms (no experts)."""
        return self.attention_params + self.router_params + self.block_norms * self.norm_params

    @property
    def layer_params(self) -> int:
        """One block of the main kind (a mixture's: routed and shared experts)."""
        return self.dense_layer_params + (self.experts + self.shared_experts) * self.expert_params

    @property
    def active_layer_params(self) -> int:
        return self.dense_layer_params + (self.top_k + self.shared_experts) * self.expert_params

    @property
    def moe(self) -> bool:
        return self.experts > 1

    @property
    def first_block_params(self) -> int:
        """One of a mixture's leading dense blocks: attention, norms, one MLP of ``dense_ffn``."""
        return self.attention_params + self.block_norms * self.norm_params + self.mlp_params(
            self.dense_ffn or self.ffn)

    def is_dense_block(self, index: int) -> bool:
        return index < self.dense_layers

    def block_params(self, index: int) -> int:
        """Block ``index``'s parameters (a leading dense block, or one of the main kind)."""
        return self.first_block_params if self.is_dense_block(index) else self.layer_params

    def routed_params(self, index: int) -> int:
        """Block ``index``'s routed experts (what expert parallelism splits); 0 in a dense block."""
        return 0 if self.is_dense_block(index) or not self.moe else self.experts * self.expert_params

    @property
    def blocks_params(self) -> int:
        return self.dense_layers * self.first_block_params + (self.layers - self.dense_layers) * self.layer_params

    @property
    def active_blocks_params(self) -> int:
        """The blocks' parameters one token uses."""
        return self.dense_layers * self.first_block_params + \
            (self.layers - self.dense_layers) * self.active_layer_params

    @property
    def attention_span(self) -> float:
        """Keys each query attends to, summed over the blocks: seq_len, or the window in local blocks."""
        local = min(self.seq_len, self.sliding_window or self.seq_len)
        return (self.layers - self.local_layers) * self.seq_len + self.local_layers * local

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
        return self.blocks_params + self.embedding_params + self.head_params

    @property
    def active_params(self) -> int:
        """Parameters one token uses: the total less the experts it is not routed to."""
        return self.active_blocks_params + self.embedding_params + self.head_params

    @property
    def lookup_params(self) -> int:
        """Parameters a token reads but does not multiply by: the input tables (token embedding,
        learned positions), unless the output layer multiplies by the tied token embedding."""
        return self.embedding_params - (self.vocab * self.hidden if self.tied else 0)

    @property
    def expert_total(self) -> int:
        """Parameters in routed expert MLPs (split further by expert parallelism; shared experts are
        not); 0 for a dense model."""
        return (self.layers - self.dense_layers) * self.experts * self.expert_params if self.moe else 0


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


def stage_blocks(layers: int, pp: int) -> list[range]:
    """The block indices of each pipeline stage (:func:`stage_layers` in order)."""
    out: list[range] = []
    start = 0
    for n in stage_layers(layers, pp):
        out.append(range(start, start + n))
        start += n
    return out


def stage_params(shape: TransformerShape, pp: int) -> list[int]:
    """Parameters held by each pipeline stage: its blocks, the embedding on the first, the
    output layer on the last. Tied embeddings keep a second copy on the last stage (Megatron's
    way: the output projection needs the weight and its gradient is all-reduced between the two)."""
    held = [sum(shape.block_params(i) for i in blocks) for blocks in stage_blocks(shape.layers, pp)]
    held[0] += shape.embedding_params
    held[-1] += shape.head_params + (shape.vocab * shape.hidden if shape.tied and pp > 1 else 0)
    return held


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
