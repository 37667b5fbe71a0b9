"""Hugging Face transformers models built from a config (offline: no hub download), as
``model.name=`` factories for ``hpctrain train``; copy one into your own module and change its sizes.

    hpctrain train model.name=examples.hf_models:gpt2 data.name=shakespeare optim.name=adamw optim.lr=0.003
    hpctrain run -n 2 train model.name=examples.hf_models:llama data.name=shakespeare parallel.strategy=fsdp

hpctrain calls a factory with the arguments its signature names (docs/own-code.md): ``vocab_size``
(the data's vocabulary for causal_lm, or ``model.vocab``), ``seq_len`` (the data's sequence length),
``num_classes``. The models return a ``ModelOutput``: hpctrain trains on its ``logits``, or on its
own ``loss`` with ``model.use_model_loss=true``. ``parallel.strategy=fsdp`` shards them one
transformer block at a time (the classes in their ``_no_split_modules``).
"""

from __future__ import annotations

from transformers import (
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)


def gpt2(vocab_size: int, seq_len: int) -> GPT2LMHeadModel:
    """A 2-block GPT-2 (width 32); ``n_positions`` covers the data's sequences."""
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=vocab_size, n_positions=seq_len,
                                      bos_token_id=None, eos_token_id=None))  # (GPT-2 tokenizer ids: none here)


def llama(vocab_size: int, seq_len: int) -> LlamaForCausalLM:
    """A 2-layer Llama (width 32, grouped-query attention, rotary positions)."""
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab_size,
                                        max_position_embeddings=seq_len))


def bert_classifier(num_classes: int, seq_len: int = 128, vocab_size: int = 1000) -> BertForSequenceClassification:
    """A 2-layer BERT classifier over token ids (integer inputs of shape (seq_len,)); its
    vocabulary is ``model.vocab`` when set (the data's token ids must be below it)."""
    return BertForSequenceClassification(BertConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                                    num_attention_heads=2, vocab_size=vocab_size,
                                                    max_position_embeddings=seq_len, num_labels=num_classes))
