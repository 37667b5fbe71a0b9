"""A transformers ``config.json`` read offline into a :class:`TransformerShape` (no transformers import).

Each family names the same quantities differently; a key with a documented transformers
default (``num_key_value_heads``, ``tie_word_embeddings``, ``n_inner``, ``head_dim``) may be absent, any
other missing key is an error naming the file and the key. What does not change the
parameter count or the FLOPs (rotary fraction, rope theta, GPT-NeoX's parallel residual, a router's
grouping, soft-capping's element-wise tanh) is read by nobody; a sliding window is read where it
is a layer's attention span by design (Gemma 2's alternating local layers), not where it is an
inference-time option (Mistral's, Phi-3's).
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
    "qwen3": {**_LLAMA, "qk_norm": True},  # an RMSNorm of head width on each query and key head
    "qwen3_moe": {**_LLAMA, "qk_norm": True},
    "deepseek_v3": _LLAMA,  # MLA attention, dense leading blocks, shared + routed experts
    "gemma2": {**_LLAMA, "block_norms": 4},  # GeGLU (three matrices), pre- and post-norms
    "phi3": _LLAMA,  # fused qkv_proj and gate_up_proj: the same matrices, counted alike
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
    """llama, mistral, mixtral, qwen2, qwen3, qwen3_moe, deepseek_v3, gemma2, phi3, gpt_neox: the
    hidden_size / num_attention_heads names.
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
    return {**fields, **_FAMILY_FIELDS.get(family, lambda *_: {})(path, config, fields)}


def _qwen3_moe(path: str, config: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """Qwen3-MoE: ``num_experts`` MLPs of ``moe_intermediate_size`` in every ``decoder_sparse_step``-th
    block not listed in ``mlp_only_layers``, the others one MLP of ``intermediate_size`` (counted as
    leading blocks: the count is exact, a pipeline's split of them approximate)."""
    layers, step = fields["layers"], _int_or(path, config, "decoder_sparse_step", 1)
    only = config.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
        raise UserError(f"--hf-config {path}: key 'mlp_only_layers' is {_short(only)}, expected a list of layer "
                        "indices")
    sparse = sum(1 for i in range(layers) if i not in only and (i + 1) % step == 0)
    if sparse == 0:
        return {}
    return {"experts": _int(path, config, "num_experts"), "top_k": _int(path, config, "num_experts_per_tok"),
            "ffn_hidden": _int(path, config, "moe_intermediate_size"), "dense_layers": layers - sparse,
            "dense_ffn": fields["ffn_hidden"]}


def _deepseek_v3(path: str, config: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-V3: multi-head latent attention (every head its own up-projected key and value), the
    first ``first_k_dense_replace`` blocks dense (``intermediate_size``), the rest ``n_routed_experts``
    + ``n_shared_experts`` MLPs of ``moe_intermediate_size``. The multi-token-prediction module
    (``num_nextn_predict_layers``) is not part of the model's 671B and is not counted."""
    if config.get("moe_layer_freq", 1) != 1:
        raise UserError(f"--hf-config {path}: key 'moe_layer_freq' is {_short(config.get('moe_layer_freq'))}; "
                        "only 1 (every block after the dense ones a mixture) is supported")
    q_lora = config.get("q_lora_rank")
    mla = {"kv_lora_rank": _int(path, config, "kv_lora_rank"), "q_lora_rank": 0 if q_lora is None else
           _int(path, config, "q_lora_rank"), "qk_rope_dim": _int(path, config, "qk_rope_head_dim"),
           "head_dim": _int(path, config, "qk_nope_head_dim"), "v_head_dim": _int(path, config, "v_head_dim"),
           "kv_heads": fields["heads"]}
    dense = _int_or(path, config, "first_k_dense_replace", 0, least=0)
    if dense > fields["layers"]:
        raise UserError(f"--hf-config {path}: key 'first_k_dense_replace' ({dense}) exceeds num_hidden_layers "
                        f"({fields['layers']})")
    return {**mla, "experts": _int(path, config, "n_routed_experts"),
            "top_k": _int(path, config, "num_experts_per_tok"),
            "ffn_hidden": _int(path, config, "moe_intermediate_size"),
            "shared_experts": _int_or(path, config, "n_shared_experts", 0, least=0), "dense_layers": dense,
            "dense_ffn": fields["ffn_hidden"]}


def _gemma2(path: str, config: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2: every other block (the even ones; or those ``layer_types`` names ``sliding_attention``)
    attends to the last ``sliding_window`` tokens; tied embeddings unless the config says otherwise."""
    types = config.get("layer_types")
    if isinstance(types, list) and len(types) == fields["layers"]:
        local = sum(1 for t in types if t == "sliding_attention")
    else:
        local = (fields["layers"] + 1) // 2
    return {"tied": _bool(path, config, "tie_word_embeddings", True), "local_layers": local,
            "sliding_window": _int(path, config, "sliding_window") if local else None}


def _phi3(path: str, config: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """Phi-3: Llama's matrices, fused; dropout under its own names."""
    return {"dropout": fields["dropout"] or _dropout(path, config, "resid_pdrop", "embd_pdrop")}


def _int_or(path: str, config: dict[str, Any], key: str, default: int, *, least: int = 1) -> int:
    """An optional integer key (absent or null: ``default``); 0 allowed where ``least`` is 0."""
    if config.get(key) is None:
        return default
    if least == 0 and config[key] == 0 and not isinstance(config[key], bool):
        return 0
    return _int(path, config, key)


_FAMILY_FIELDS = {"qwen3_moe": _qwen3_moe, "deepseek_v3": _deepseek_v3, "gemma2": _gemma2, "phi3": _phi3}


def _gpt2(path: str, config: dict[str, Any]) -> dict[str, Any]:
    hidden = _int(path, config, "n_embd")
    positions = _int(path, config, "n_positions")
    return {"layers": _int(path, config, "n_layer"), "hidden": hidden, "heads": _int(path, config, "n_head"),
            "seq_len": positions, "max_positions": positions, "vocab": _int(path, config, "vocab_size"),
            # null in GPT-2's configs: 4h
            "ffn_hidden": 4 * hidden if config.get("n_inner") is None else _int(path, config, "n_inner"),
            "tied": _bool(path, config, "tie_word_embeddings", True),
            "dropout": _dropout(path, config, "resid_pdrop", "attn_pdrop", "embd_pdrop")}
