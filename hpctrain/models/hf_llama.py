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
No ``transformers`` import here: the classes are matched by name.
"""

from __future__ import annotations

import torch
from torch import nn

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


class CausalLMStage(nn.Module):
    """One pipeline stage of a cut Hugging Face Llama-family model: its decoder layers, plus the
    embedding on the first stage and the final norm and ``lm_head`` on the last (the others are
    None). It keeps the model's own children (``model``, ``lm_head``), so its parameter names are
    the whole model's and a checkpoint or export of the stages is the whole model's.

    Takes token ids (first stage) or hidden states, returns hidden states or the logits (last).
    Runs the layers as ``LlamaModel.forward`` does for a training batch (no padding mask, no
    cache): positions ``0..T-1``, causal attention (a None mask under SDPA is causal)."""

    def __init__(self, cut: nn.Module) -> None:
        super().__init__()
        self.model = cut.get_submodule("model")
        self.lm_head = getattr(cut, "lm_head", None)
        self.config = getattr(cut, "config", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        embed, norm = self._part("embed_tokens"), self._part("norm")
        hidden = x if embed is None else embed(x)
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        rotary = self.model.get_submodule("rotary_emb")(hidden, positions)
        mask = self._mask(hidden)
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
