"""The attention hpctrain's transformers (``gpt``, ``llama``) call: causal scaled-dot-product
attention, plain, within packed documents, or over a sequence split across ranks.

* Plain (no ``doc_ids``, no split): ``F.scaled_dot_product_attention(is_causal=True)``, the
  fused kernel; positions ``0..T-1``.
* Packed documents: ``doc_ids`` ``(B, T)`` (the document index of each token in its window,
  non-decreasing) give a block-diagonal causal mask, so no token attends across a document, and
  positions that restart at 0 at each document's first token (:func:`document_positions`): a
  document packed after another gives the logits it gives alone.
* Context parallel: a model whose root carries a :class:`SequenceSplit` (attribute
  :data:`SPLIT_ATTR`, set by ``hpctrain.parallel.context``) computes only this rank's chunks of
  the sequence: :func:`prepare` picks them from the full-length tokens (every rank of a
  context-parallel group reads the same batch) with their global positions, and :func:`attend`
  all-gathers the keys and values of the group (autograd through the collective) and masks by
  global token index, so each query sees exactly the keys it sees in one process. Documents
  work the same way: the mask compares the document ids of the local queries and the gathered
  keys (every rank holds the window's full ``doc_ids``). Under torch's ring attention (CUDA,
  ``split.ring``) the keys stay local and torch's patched SDPA passes them around the ring.

A meta-device forward (FLOP counting, shape checks) has no data to split: it runs the whole
sequence, so it counts the whole model's FLOPs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

# the root module attribute that holds a model's SequenceSplit (context parallel)
SPLIT_ATTR = "context_split"


class SequenceSplit(Protocol):
    """A sequence split over the ranks of a group (:class:`hpctrain.parallel.context.ContextSplit`):
    each rank holds some of the tokens of every window, in chunks."""

    size: int  # ranks in the group
    ring: bool  # True: torch's ring attention exchanges the keys (local k, v to SDPA); False: all-gather them

    def indices(self, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(this rank's token indices, the token indices of :meth:`gather`'s output), for windows of ``length``."""
        ...

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's ``x`` concatenated along ``dim`` in rank order, differentiable (the
        gradient of each part returns, summed, to its rank)."""
        ...

    def causal_mask(self, length: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """The additive causal mask ``(1, 1, local, length)`` of this rank's queries over the gathered keys."""
        ...


def split_of(model: object) -> SequenceSplit | None:
    """The split ``model`` computes its sequence over (:func:`use_split`), None: the whole sequence."""
    split: SequenceSplit | None = getattr(model, SPLIT_ATTR, None)
    return split


def use_split(model: torch.nn.Module, split: SequenceSplit | None) -> None:
    """Make ``model`` (a ``gpt`` or ``llama``: a root whose forward calls :func:`prepare`) compute
    its share of each sequence over ``split`` (None: the whole sequence again)."""
    setattr(model, SPLIT_ATTR, split)  # a plain attribute: not a submodule, not in the state dict


@dataclass
class AttentionContext:
    """What every attention layer of one forward shares, built once by :func:`prepare`."""

    positions: torch.Tensor  # of the tokens this rank computes: (T,), or (B, T) within documents
    mask: torch.Tensor | None = None  # bool (B|1, 1, queries, keys), True = may attend; None: plain causal
    split: SequenceSplit | None = None
    _typed: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)

    def additive(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The mask as SDPA's additive float mask, made once per dtype: SDPA would convert a bool
        mask in every layer, and every layer would save its own copy for backward."""
        if self.mask is None:
            return None
        if dtype not in self._typed:
            self._typed[dtype] = torch.zeros(self.mask.shape, dtype=dtype, device=self.mask.device).masked_fill_(
                ~self.mask, float("-inf"))
        return self._typed[dtype]


def document_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """``(B, T)`` positions that restart at 0 at the first token of each document of ``doc_ids``."""
    index = torch.arange(doc_ids.shape[1], device=doc_ids.device).expand_as(doc_ids)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    first = torch.where(starts, index, 0).cummax(dim=1).values  # the index of the document's first token
    return index - first


def prepare(tokens: torch.Tensor, doc_ids: torch.Tensor | None = None,
            split: SequenceSplit | None = None) -> tuple[torch.Tensor, AttentionContext | None]:
    """This rank's tokens and the attention context of one forward (None: plain causal attention
    over positions 0..T-1, the fused kernel's path, unchanged)."""
    if split is not None and tokens.device.type == "meta":
        split = None  # no data to split: the whole sequence (FLOP counts, shape checks)
    length, device = tokens.shape[1], tokens.device
    if doc_ids is not None and tuple(doc_ids.shape) != tuple(tokens.shape):
        raise ValueError(f"doc_ids has shape {tuple(doc_ids.shape)}, the tokens {tuple(tokens.shape)}: one "
                         "document id per token")
    if split is None:
        if doc_ids is None:
            return tokens, None  # the plain path: nothing to compute
        index = torch.arange(length, device=device)
        return tokens, AttentionContext(document_positions(doc_ids), _allowed(index, index, doc_ids, doc_ids))
    if length % (2 * split.size):
        raise ValueError(f"a sequence of {length} tokens does not split into 2 x {split.size} equal chunks (context "
                         f"parallel); hint: a model.seq_len that is a multiple of {2 * split.size}")
    mine, gathered = split.indices(length, device)
    # a rank's positions: its chunks' indices, or within their documents
    positions = mine if doc_ids is None else document_positions(doc_ids).index_select(-1, mine)
    tokens = tokens.index_select(1, mine)
    if doc_ids is None:
        return tokens, AttentionContext(positions, split=split)
    if split.ring:
        raise ValueError("packed documents (doc_ids) under torch's ring attention (context parallel on CUDA) are "
                         "not supported: its SDPA takes no mask")
    mask = _allowed(mine, gathered, doc_ids.index_select(1, mine), doc_ids.index_select(1, gathered))
    return tokens, AttentionContext(positions, mask, split)


def _allowed(queries: torch.Tensor, keys: torch.Tensor, query_docs: torch.Tensor | None = None,
             key_docs: torch.Tensor | None = None) -> torch.Tensor:
    """Which key each query may see: an earlier (or the same) token, of the same document."""
    allowed = keys[None, :] <= queries[:, None]
    if query_docs is not None and key_docs is not None:
        allowed = allowed & (query_docs[:, :, None] == key_docs[:, None, :])
    return allowed[:, None] if allowed.dim() == 3 else allowed[None, None]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttentionContext | None = None, *,
           dropout_p: float = 0.0, scale: float | None = None) -> torch.Tensor:
    """Causal attention of ``q`` ``(B, heads, T, head_dim)`` over ``k``, ``v`` ``(B, kv_heads, T,
    head_dim)`` (grouped-query when fewer key/value heads: SDPA shares them, no repeated copy)."""
    gqa = q.shape[1] != k.shape[1]
    split = ctx.split if ctx is not None and q.device.type != "meta" else None
    if split is not None and not split.ring:
        k, v = split.gather(k, 2), split.gather(v, 2)
    elif split is not None and gqa:  # torch's ring SDPA takes no enable_gqa: whole heads, repeated
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        gqa = False
    mask = ctx.additive(q.dtype) if ctx is not None else None
    if mask is None and split is not None and not split.ring:
        mask = split.causal_mask(k.shape[2], q.device, q.dtype)
    if mask is None:  # plain, or torch's ring attention (which offsets the causal mask itself)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p, scale=scale,
                                              enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale, enable_gqa=gqa)
