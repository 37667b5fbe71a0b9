"""A transformers ``config.json`` read offline into a :class:`TransformerShape` (no transformers import).

Each family names the same quantities differently; a key with a documented transformers
default (``num_key_value_heads``, ``tie_word_embeddings``, ``n_inner``, ``head_dim``) may be absent, any
other missing key is an error naming the file and the key. What does not change the
parameter count or the FLOPs (rotary fraction, rope theta, sliding windows, GPT-NeoX's
parallel residual) is read by nobody.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

from hpctrain.core import safe_open
from hpctrain.core.errors import UserError
from hpctrain.estimate.bounds import check_dims

# a config.json is a few kB (with a label map, some hundred); more is another file named by mistake
CONFIG_LIMIT = safe_open.Limit("a transformers config.json", "HPCTRAIN_MAX_HF_CONFIG_BYTES", 4 << 20)

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
    if not isinstance(family, str) or family not in _FAMILIES:
        raise UserError(f"--hf-config {path}: model_type {_short(family)} is not supported; "
                        f"supported: {', '.join(_FAMILIES)}")
    fields = {**_FAMILIES[family], **(_gpt2(path, config) if family == "gpt2" else _llama_like(path, config, family))}
    return HFConfig(fields, f"--hf-config {path} ({family})",
                    "n_positions" if family == "gpt2" else "max_position_embeddings")


def _load(path: str) -> dict[str, Any]:
    """The file's JSON object, read through the bounded regular-file open: a FIFO, a device or a
    symlink to one is refused before it is opened (never waited on, never read without end)."""
    try:
        data = safe_open.read_regular(path, limit=CONFIG_LIMIT.bytes())
    except FileNotFoundError:
        raise UserError(f"--hf-config {path}: no such file (give the config.json of a downloaded model)") from None
    except safe_open.NotRegularError as err:
        raise UserError(f"--hf-config {path}: a {err.kind}, not a regular file (give the config.json of a "
                        "downloaded model)") from None
    except safe_open.TooLargeError as err:
        raise UserError(f"--hf-config {CONFIG_LIMIT.refusal(path, err.size)}") from None
    except OSError as err:
        raise UserError(f"--hf-config {path}: cannot be read ({err.strerror or err})") from None
    try:
        config = json.loads(data)
    except (ValueError, RecursionError) as err:  # bad JSON or UTF-8, a 5,000-digit number, deep nesting
        raise UserError(f"--hf-config {path}: not a readable JSON file ({str(err)[:200]})") from None
    if not isinstance(config, dict):
        raise UserError(f"--hf-config {path}: expected a JSON object, got {type(config).__name__}")
    return config


def _need(path: str, config: dict[str, Any], key: str) -> Any:
    if config.get(key) is None:
        raise UserError(f"--hf-config {path}: key {key!r} missing (model_type {config.get('model_type')!r} needs it)")
    return config[key]


def _int(path: str, config: dict[str, Any], key: str) -> int:
    """A positive integer within :mod:`hpctrain.estimate.bounds`' limits (a key naming layers or
    experts has their limit, any other width 2^40)."""
    value = _need(path, config, key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise UserError(f"--hf-config {path}: key {key!r} is {_short(value)}, expected a positive integer")
    check_dims({f"key {key!r}": value}, f"--hf-config {path}")
    return value


def _short(value: Any) -> str:
    """A value as the message shows it: a config's list or huge number cut short."""
    text = repr(value) if not isinstance(value, int) or value.bit_length() < 200 else f"an integer of " \
        f"{value.bit_length():,} bits"
    return text if len(text) <= 60 else text[:57] + "..."


def _bool(path: str, config: dict[str, Any], key: str, default: bool) -> bool:
    """A JSON true/false: the string "false" is not false (``bool("false")`` is True)."""
    value = config.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise UserError(f"--hf-config {path}: key {key!r} is {_short(value)}, expected true or false")
    return value


def _dropout(path: str, config: dict[str, Any], *keys: str) -> bool:
    """Any dropout probability above 0 (each a number in [0, 1], or absent)."""
    for key in keys:
        value = config.get(key) or 0
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
            raise UserError(f"--hf-config {path}: key {key!r} is {_short(value)}, expected a probability in [0, 1]")
    return any(config.get(key) or 0 for key in keys)


def _llama_like(path: str, config: dict[str, Any], family: str) -> dict[str, Any]:
    """llama, mistral, mixtral, qwen2, gpt_neox: the hidden_size / num_attention_heads names.
    The context length is max_position_embeddings unless --seq-len says otherwise."""
    heads = _int(path, config, "num_attention_heads")
    fields: dict[str, Any] = {
        "layers": _int(path, config, "num_hidden_layers"), "hidden": _int(path, config, "hidden_size"),
        "heads": heads, "seq_len": _int(path, config, "max_position_embeddings"),
        "vocab": _int(path, config, "vocab_size"), "ffn_hidden": _int(path, config, "intermediate_size"),
        # absent or null: multi-head attention (transformers' default); 0 is no config's value, so refused
        "kv_heads": heads if config.get("num_key_value_heads") is None else _int(path, config, "num_key_value_heads"),
        "tied": _bool(path, config, "tie_word_embeddings", False),  # transformers' default for these families
        "dropout": _dropout(path, config, "attention_dropout", "hidden_dropout"),
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
            # null in GPT-2's configs: 4h
            "ffn_hidden": 4 * hidden if config.get("n_inner") is None else _int(path, config, "n_inner"),
            "tied": _bool(path, config, "tie_word_embeddings", True),
            "dropout": _dropout(path, config, "resid_pdrop", "attn_pdrop", "embd_pdrop")}
