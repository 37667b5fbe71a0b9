"""What the planner knows of a model (:class:`Profile`), torch-free.

Two sources:

- the built-in transformers (``gpt``, ``llama`` with no ``model.family``) are described by their
  :class:`~hpctrain.models.shape.TransformerShape` alone, from the ``model`` config section
  (:func:`builtin_shape`): parameter counts, FLOPs and, through the per-strategy memory
  declaration (:mod:`hpctrain.estimate.strategy_memory`), every byte a rank holds. No model is
  built and no torch is imported, so ``hpctrain plan`` answers on a login node in well under a
  second, and ``parallel.strategy=auto`` on the GPU node computes exactly the same numbers;
- any other model (the CNNs, users' models) is built on the meta device and measured
  (:func:`hpctrain.planning.autosize.profile`, which needs torch).

The shapes here are the model families' (:func:`hpctrain.models.family.gpt_shape`,
``llama_shape``), written without their module's torch import; tests/planning checks they agree.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hpctrain.config.model import ModelConfig
from hpctrain.estimate.flops import attention_flops, model_flops
from hpctrain.models.shape import TransformerShape, llama_ffn

LEAF_MODULES_PER_BLOCK = 10  # norms, q k v o, MLP matrices, activation: a proxy for kernel launches
LEAF_MODULES_ENDS = 4  # embedding(s), final norm, head


@dataclass(frozen=True)
class Saved:
    """Bytes saved for backward per sample: before the blocks, in each block, after them (with the loss)."""

    first: float
    blocks: tuple[float, ...]
    last: float


@dataclass(frozen=True, eq=False)  # hashed by identity: the search caches per-layout figures of one profile
class Profile:
    name: str
    first_params: int  # elements before the blocks (a model without blocks: all of them)
    block_params: tuple[int, ...]
    block_split: tuple[int, ...]  # of each block's elements, those tensor parallelism splits
    last_params: int
    shared_params: int  # in both end pieces (tied embeddings): held once when one rank holds both
    param_bytes: int  # bytes per parameter element (fp32 masters: 4)
    saved: dict[str, Saved] | None  # measured, by activation-checkpointing mode; None: declared from the shape
    flops_per_sample: float  # forward + backward
    block_flops_per_sample: float  # forward + backward of all blocks (recomputed under block checkpointing)
    modules: int  # leaf modules: a proxy for kernels per forward
    shape: TransformerShape | None  # for the tensor-parallel split of activations and its traffic
    tokens_per_sample: int | None  # causal LM: the sequence length
    vocab_parallel: bool = False  # tp splits the token embedding, the head and the logits by vocabulary

    @property
    def params(self) -> int:
        return self.first_params + sum(self.block_params) + self.last_params - self.shared_params

    @property
    def tensor_parallel(self) -> bool:
        """Can tensor parallelism split the blocks (Linears named as the tp plan expects)?"""
        return bool(self.block_split) and all(self.block_split) and self.shape is not None

    @property
    def declared(self) -> bool:
        """Memory from the strategies' declaration: the model has a transformer shape (a built-in's,
        or a measured model's family's), not only a meta measurement."""
        return self.shape is not None

    @property
    def builtin(self) -> bool:
        """A built-in transformer known by its shape alone (no model was built or measured)."""
        return self.saved is None and self.shape is not None


def gpt_shape(cfg: ModelConfig) -> TransformerShape:
    """hpctrain's gpt: GPT-2's layout, vocabulary model.vocab or 256 (bytes)."""
    return TransformerShape(layers=cfg.n_layers, hidden=cfg.hidden, heads=cfg.heads, seq_len=cfg.seq_len,
                            vocab=cfg.vocab or 256, tied=cfg.tie_weights, dropout=cfg.dropout > 0,
                            bias="all" if cfg.bias else "none")


def llama_shape(cfg: ModelConfig) -> TransformerShape:
    """hpctrain's llama: RMSNorm, rotary, SwiGLU, grouped-query attention, no biases, no dropout."""
    return TransformerShape(layers=cfg.n_layers, hidden=cfg.hidden, heads=cfg.heads, seq_len=cfg.seq_len,
                            vocab=cfg.vocab or 256, kv_heads=cfg.kv_heads or cfg.heads,
                            ffn_hidden=cfg.ffn_hidden or llama_ffn(cfg.hidden), mlp="swiglu", tied=cfg.tie_weights,
                            positions="rotary", norm="rmsnorm", bias="none", dropout=False,
                            **_experts(cfg))


def _experts(cfg: ModelConfig) -> dict[str, Any]:
    """A mixture of experts (``model.experts``, ``model.top_k``, ``model.shared_expert``, where the
    config has them)."""
    experts = int(getattr(cfg, "experts", 0) or 0)
    if experts <= 1:
        return {}
    return {"experts": experts, "top_k": int(getattr(cfg, "top_k", 1) or 1),
            "shared_experts": 1 if getattr(cfg, "shared_expert", False) else 0}


# name -> (shape, whether tensor parallelism splits the ends by vocabulary, as the family's tensor plan does)
BUILTIN: dict[str, tuple[Callable[[ModelConfig], TransformerShape], bool]] = {
    "gpt": (gpt_shape, False),
    "llama": (llama_shape, True),
}


def builtin_shape(cfg: ModelConfig) -> tuple[TransformerShape, bool] | None:
    """(shape, vocab_parallel) of a built-in transformer, or None (another model, or one built
    under a ``model.family`` whose plans may differ)."""
    entry = BUILTIN.get(cfg.name)
    if entry is None or cfg.family is not None:
        return None
    shape_of, vocab_parallel = entry
    return shape_of(cfg), vocab_parallel


def shape_profile(cfg: ModelConfig, shape: TransformerShape, *, vocab_parallel: bool) -> Profile:
    """A transformer's profile from its shape: the pieces a pipeline places (embedding, blocks,
    final norm and head), the share of a block tensor parallelism splits (its projections), and
    FLOPs by the estimator's formulas (6 x the parameters a token multiplies by, plus attention)."""
    tokens = shape.seq_len
    head = shape.norm_params + shape.vocab * shape.hidden  # the output projection, tied or not
    shared = shape.vocab * shape.hidden if shape.tied else 0
    split = shape.attention_params + shape.experts * shape.expert_params
    block_flops = 6.0 * shape.layers * shape.active_layer_params * tokens + attention_flops(shape, tokens)
    return Profile(cfg.name, shape.embedding_params, (shape.layer_params,) * shape.layers, (split,) * shape.layers,
                   head, shared, 4, None, model_flops(shape, tokens), block_flops,
                   LEAF_MODULES_PER_BLOCK * shape.layers + LEAF_MODULES_ENDS, shape, tokens,
                   vocab_parallel=vocab_parallel)
