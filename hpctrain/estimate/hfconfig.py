"""A transformers ``config.json`` read offline into a :class:`TransformerShape` (no transformers import).

Each family names the same quantities differently; a key with a documented transformers
default (``num_key_value_heads``, ``tie_word_embeddings``, ``n_inner``, ``head_dim``) may be absent, any
other missing key is an error naming the file and the key. What does not change the
parameter count or the FLOPs (rotary fraction, rope theta, sliding windows, GPT-NeoX's
parallel residual) is read by nobody.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

from hpctrain.core.errors import UserError

# model_type -> how its architecture differs from GPT-2 (keys the estimator's shape takes)
_LLAMA = {"mlp": "swiglu", "positions": "rotary", "norm": "rmsnorm", "bias": "none"}
_FAMILIES: dict[str, dict[str, Any]] = {
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "mixtral": _LLAMA,
    "qwen2": {**_LLAMA, "bias": "qkv"},  # Qwen2 keeps biases on q, k and v
    "gpt2": {},
    "gpt_neox": {"positions": "rotary"},
}


class HFConfig(NamedTuple):
    fields: dict[str, Any]  # TransformerShape's keyword arguments
    source: str  # "--hf-config PATH (family)", for the report
    context_key: str  # the key the sequence length came from: the longest context the model accepts


def read(path: str) -> tuple[dict[str, Any], str]:
    """The :class:`TransformerShape` fields from ``path`` (flags may override them) and a description."""
    fields, source, _ = load(path)
    return fields, source


def load(path: str) -> HFConfig:
    """:func:`read`, and the key that gave the sequence length (``max_position_embeddings``,
    GPT-2's ``n_positions``): a default the CLI reports, since it is rarely the training length."""
    config = _load(path)
    family = config.get("model_type")
    if family is None:
        raise UserError(f"--hf-config {path}: key 'model_type' missing; a transformers config.json names its family")
    if family not in _FAMILIES:
        raise UserError(f"--hf-config {path}: model_type {family!r} is not supported; "
                        f"supported: {', '.join(_FAMILIES)}")
    fields = {**_FAMILIES[family], **(_gpt2(path, config) if family == "gpt2" else _llama_like(path, config, family))}
    return HFConfig(fields, f"--hf-config {path} ({family})",
                    "n_positions" if family == "gpt2" else "max_position_embeddings")


def _load(path: str) -> dict[str, Any]:
    try:
        config = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UserError(f"--hf-config {path}: no such file (give the config.json of a downloaded model)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"--hf-config {path}: not a readable JSON file ({err})") from None
    if not isinstance(config, dict):
        raise UserError(f"--hf-config {path}: expected a JSON object, got {type(config).__name__}")
    return config


def _need(path: str, config: dict[str, Any], key: str) -> Any:
    if config.get(key) is None:
        raise UserError(f"--hf-config {path}: key {key!r} missing (model_type {config.get('model_type')!r} needs it)")
    return config[key]


def _int(path: str, config: dict[str, Any], key: str) -> int:
    value = _need(path, config, key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise UserError(f"--hf-config {path}: key {key!r} is {value!r}, expected a positive integer")
    return value


def _dropout(config: dict[str, Any], *keys: str) -> bool:
    return any(float(config.get(key) or 0) > 0 for key in keys)


def _llama_like(path: str, config: dict[str, Any], family: str) -> dict[str, Any]:
    """llama, mistral, mixtral, qwen2, gpt_neox: the hidden_size / num_attention_heads names.
    The context length is max_position_embeddings unless --seq-len says otherwise."""
    heads = _int(path, config, "num_attention_heads")
    fields: dict[str, Any] = {
        "layers": _int(path, config, "num_hidden_layers"), "hidden": _int(path, config, "hidden_size"),
        "heads": heads, "seq_len": _int(path, config, "max_position_embeddings"),
        "vocab": _int(path, config, "vocab_size"), "ffn_hidden": _int(path, config, "intermediate_size"),
        "kv_heads": _int(path, config, "num_key_value_heads") if config.get("num_key_value_heads") else heads,
        "tied": bool(config.get("tie_word_embeddings", False)),  # transformers' default for these families
        "dropout": _dropout(config, "attention_dropout", "hidden_dropout"),
    }
    if config.get("head_dim") is not None:  # narrower heads than hidden / heads (Mistral NeMo: 32 x 128 < 5120)
        fields["head_dim"] = _int(path, config, "head_dim")
    if family == "mixtral":
        fields["experts"] = _int(path, config, "num_local_experts")
        fields["top_k"] = _int(path, config, "num_experts_per_tok")
    return fields


def _gpt2(path: str, config: dict[str, Any]) -> dict[str, Any]:
    hidden = _int(path, config, "n_embd")
    positions = _int(path, config, "n_positions")
    return {"layers": _int(path, config, "n_layer"), "hidden": hidden, "heads": _int(path, config, "n_head"),
            "seq_len": positions, "max_positions": positions, "vocab": _int(path, config, "vocab_size"),
            "ffn_hidden": config.get("n_inner") or 4 * hidden,  # null in GPT-2's configs: 4h
            "tied": bool(config.get("tie_word_embeddings", True)),
            "dropout": _dropout(config, "resid_pdrop", "attn_pdrop", "embd_pdrop")}
