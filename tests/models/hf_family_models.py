"""Tiny Hugging Face Llama-family causal LMs (2 layers, width 32, grouped-query attention, fp32,
untied: a pipeline cannot share the embedding between stages) as ``model.name=`` factories for
tests/models/test_hf_family_parallel.py."""

from __future__ import annotations

from typing import Any

from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

SIZES: dict[str, Any] = {"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
                         "num_key_value_heads": 2, "tie_word_embeddings": False, "attn_implementation": "sdpa"}


def llama(vocab_size: int, seq_len: int) -> LlamaForCausalLM:
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab_size, max_position_embeddings=seq_len, **SIZES))


def mistral(vocab_size: int, seq_len: int) -> MistralForCausalLM:
    return MistralForCausalLM(MistralConfig(vocab_size=vocab_size, max_position_embeddings=seq_len, **SIZES))


def qwen2(vocab_size: int, seq_len: int) -> Qwen2ForCausalLM:
    """Qwen2: biases on q, k and v (split with their columns)."""
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab_size, max_position_embeddings=seq_len, **SIZES))


def tied_llama(vocab_size: int, seq_len: int) -> LlamaForCausalLM:
    """The embedding shared with ``lm_head``: no pipeline can cut it."""
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab_size, max_position_embeddings=seq_len,
                                        **(SIZES | {"tie_word_embeddings": True})))
