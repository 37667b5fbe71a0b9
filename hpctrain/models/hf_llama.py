"""Hugging Face Llama-family causal LMs (``LlamaForCausalLM``, ``MistralForCausalLM``,
``Qwen2ForCausalLM``): the module names their tensor-parallel plan and pipeline split read, and
the pipeline stage that runs a cut model. :mod:`hpctrain.models.family` bundles them as the
``hf-llama`` family, chosen for a model whose class is one of :data:`CLASSES`.

The three share one layout (``transformers``' own ``base_model_tp_plan`` for them names the same
modules): ``model.embed_tokens``, ``model.layers`` of decoder layers (``self_attn.q_proj``,
``k_proj``, ``v_proj``, ``o_proj``; ``mlp.gate_proj``, ``up_proj``, ``down_proj``; two RMSNorms),
``model.norm``, ``model.rotary_emb`` (no parameters) and ``lm_head``. The attention reshapes
with ``view(*shape, -1, head_dim)``, so a rank holding ``heads / tp`` query and ``kv_heads / tp``
key/value heads runs the same code on its shard; rotary positions are per head, untouched.
No ``transformers`` import here: the classes are matched by name (context parallel imports it
when applied: a Hugging Face model is there).

Packed documents (``data.packing=documents``): :func:`takes_document_positions` says a model
(PEFT-wrapped too) masks by per-document ``position_ids`` (transformers' packing collator's: with no
``attention_mask`` transformers >= 4.53 finds the documents where the positions restart and masks
block-diagonally; flash-attention runs its varlen kernel); :mod:`hpctrain.tasks.inputs` passes them.
A pipeline stage (:class:`CausalLMStage`) takes the ``doc_ids`` themselves and builds that mask.

Context parallel (:func:`use_split`): the attention layers run :func:`split_attention`, an
attention function registered with ``transformers``' ``AttentionInterface`` that gathers the keys
and values over the split (hpctrain.models.attention), and a forward pre-hook keeps this rank's
chunks of the input ids with their global ``position_ids`` (rotary positions per chunk).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hpctrain.models.attention import (
    SPLIT_ATTR,
    AttentionContext,
    SequenceSplit,
    attend,
    document_positions,
    prepare,
)

CLASSES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")

BLOCKS = "model.layers"
# in a decoder layer: split q/k/v and gate/up by output columns, o and down by input rows
LAYERS = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
          "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise",
          "mlp.down_proj": "rowwise"}
ENDS = {"model.embed_tokens": "embedding", "lm_head": "head"}  # vocabulary-parallel, as hpctrain's llama
HEADS = (("self_attn.q_proj", "heads (num_attention_heads)"),
         ("self_attn.k_proj", "key/value heads (num_key_value_heads)"))
# head counts some transformers versions keep on the attention module and reshape by: local under tp
DIVIDE = ("num_heads", "num_key_value_heads")
FIRST, LAST = ("model.embed_tokens",), ("model.norm", "lm_head")


def is_llama_family(model: nn.Module) -> bool:
    return type(model).__name__ in CLASSES


def takes_document_positions(model: nn.Module) -> bool:
    """Does ``model`` (a Llama-family model, or a PEFT model around one) mask packed documents by
    ``position_ids`` restarting at each? Not under context parallel (its hook sets the positions),
    nor with a transformers that has no packed-sequence masks (older than 4.53: it would cross them)."""
    get_base = getattr(model, "get_base_model", None)  # a PEFT model: the transformers model inside
    base = get_base() if callable(get_base) else model
    if not isinstance(base, nn.Module) or not is_llama_family(base):
        return False
    if any(hasattr(m, SPLIT_ATTR) for m in base.modules()):
        return False
    return _packed_masks()


def _packed_masks() -> bool:
    try:
        from transformers import masking_utils
    except ImportError:
        return False
    return hasattr(masking_utils, "find_packed_sequence_indices")


class CausalLMStage(nn.Module):
    """One pipeline stage of a cut Hugging Face Llama-family model: its decoder layers, plus the
    embedding on the first stage and the final norm and ``lm_head`` on the last (the others are
    None). It keeps the model's own children (``model``, ``lm_head``), so its parameter names are
    the whole model's and a checkpoint or export of the stages is the whole model's.

    Takes token ids (first stage) or hidden states, returns hidden states or the logits (last).
    Runs the layers as ``LlamaModel.forward`` does for a training batch (no cache): positions
    ``0..T-1``, causal attention (a None mask under SDPA is causal); with packed documents'
    ``doc_ids`` (every stage gets them) positions restarting per document and a block-diagonal
    causal mask; with an ``attention_mask`` (1: a real token) padding keys masked too."""

    def __init__(self, cut: nn.Module) -> None:
        super().__init__()
        self.model = cut.get_submodule("model")
        self.lm_head = getattr(cut, "lm_head", None)
        self.config = getattr(cut, "config", None)

    def forward(self, x: torch.Tensor, doc_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        embed, norm = self._part("embed_tokens"), self._part("norm")
        hidden = x if embed is None else embed(x)
        positions = (torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0) if doc_ids is None
                     else document_positions(doc_ids))
        rotary = self.model.get_submodule("rotary_emb")(hidden, positions)
        mask = self._mask(hidden) if doc_ids is None and attention_mask is None else \
            _block_mask(hidden, doc_ids, attention_mask)
        for layer in self.model.get_submodule("layers").children():
            out = layer(hidden, attention_mask=mask, position_ids=positions, position_embeddings=rotary)
            hidden = out[0] if isinstance(out, tuple) else out  # older transformers return a tuple
        if norm is not None:
            hidden = norm(hidden)
        return hidden if self.lm_head is None else self.lm_head(hidden)

    def _part(self, name: str) -> nn.Module | None:
        """The inner model's child ``name``, None on a stage that does not hold it."""
        part = getattr(self.model, name, None)
        return part if isinstance(part, nn.Module) else None

    def _mask(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """SDPA: None (its causal kernel, as the whole model runs); other attentions: the additive causal mask."""
        if getattr(self.config, "_attn_implementation", "sdpa") == "sdpa":
            return None
        t = hidden.shape[1]
        blocked = torch.full((t, t), torch.finfo(hidden.dtype).min, device=hidden.device, dtype=hidden.dtype)
        return blocked.triu(1)[None, None]


def _block_mask(hidden: torch.Tensor, doc_ids: torch.Tensor | None, attention_mask: torch.Tensor | None
                ) -> torch.Tensor:
    """The additive ``(B, 1, T, T)`` mask: an earlier (or the same) token, of the same document, not
    padding. The dtype's minimum, not -inf, as transformers' own masks: a padding query that sees
    no key gets a uniform row instead of nan (its output counts nowhere)."""
    t = hidden.shape[1]
    index = torch.arange(t, device=hidden.device)
    allowed = (index[None, :] <= index[:, None])[None]
    if doc_ids is not None:
        allowed = allowed & (doc_ids[:, :, None] == doc_ids[:, None, :])
    if attention_mask is not None:
        allowed = allowed & attention_mask[:, None, :].bool()
    blocked = torch.zeros(allowed.shape, dtype=hidden.dtype, device=hidden.device)
    return blocked.masked_fill_(~allowed, torch.finfo(hidden.dtype).min)[:, None]


# ---------------------------------------------------------------- context parallel

ATTENTION = "hpctrain_context"  # the attention implementation context parallel registers in transformers


def use_split(model: nn.Module, split: SequenceSplit) -> None:
    """Make a Llama-family model compute this rank's chunks of each sequence over ``split``."""
    from transformers import AttentionInterface  # optional dependency: only a Hugging Face model gets here

    AttentionInterface.register(ATTENTION, split_attention)
    for module in model.modules():
        if hasattr(module, "q_proj") and hasattr(module, "head_dim"):  # an attention layer
            setattr(module, SPLIT_ATTR, split)
    setter = getattr(model, "set_attn_implementation", None)
    if callable(setter):
        setter(ATTENTION)
    else:  # an older transformers: the config's attribute is what the layers read
        model.config._attn_implementation = ATTENTION  # type: ignore[union-attr]
    model.register_forward_pre_hook(LocalChunks(split), with_kwargs=True)


def split_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                    **_kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function interface: causal attention of this rank's queries over the
    split's gathered keys and values (no split, or on meta: over the whole sequence). Its mask
    (padding) is None: transformers builds none for an implementation it has no mask function for,
    and right padding is never attended by a real token under the causal mask."""
    split: SequenceSplit | None = getattr(module, SPLIT_ATTR, None)
    ctx = None
    if split is not None and query.device.type != "meta":
        mine = split.indices(query.shape[2] * split.size, query.device)[0]
        ctx = AttentionContext(mine, split=split)
    out = attend(query, key, value, ctx, dropout_p=dropout, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


class LocalChunks:
    """A forward pre-hook: the input ids (and padding mask) of this rank's chunks, with their global
    ``position_ids``. An object, not a closure: the model still pickles."""

    def __init__(self, split: SequenceSplit) -> None:
        self.split = split

    def __call__(self, _module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                 ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        ids = args[0] if args else kwargs.get("input_ids")
        if not isinstance(ids, torch.Tensor) or ids.device.type == "meta":
            return None
        local, ctx = prepare(ids, None, self.split)
        assert ctx is not None  # a split always gives a context
        kwargs = {**kwargs, "position_ids": ctx.positions[None].expand(ids.shape[0], -1)}
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 2:
            kwargs["attention_mask"] = self.split_mask(mask)
        if args:
            return (local, *args[1:]), kwargs
        return args, {**kwargs, "input_ids": local}

    def split_mask(self, mask: torch.Tensor) -> torch.Tensor:
        return mask.index_select(1, self.split.indices(mask.shape[1], mask.device)[0])
