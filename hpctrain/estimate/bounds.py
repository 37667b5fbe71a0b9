"""Sizes beyond physical sense, refused before anything is computed (``hpctrain estimate``,
``hpctrain plan``, ``parallel.strategy=auto``).

A size past these is a typo or an attack, never a training run: more GPUs than any machine has,
a layer, a vocabulary table or a global batch of more than 2^40 elements (4 TiB of bf16 in one
layer; Llama 3 405B's batch is 2^24 tokens), a budget that is NaN or infinite. Arithmetic on them
overflows floats (an "inf T parameters" report), builds lists of billions of entries (a
MemoryError after 20 s) or loops for minutes; refused here in microseconds instead, with one line
naming the flag or key, the value and the limit. Each limit is far above what is built today, so
no real job meets it (docs/estimate.md, "Limits").
"""

from __future__ import annotations

import math

from hpctrain.core.errors import UserError
from hpctrain.models.shape import TransformerShape

MAX_GPUS = 1 << 20  # 1,048,576: five times the largest cluster announced (xAI Colossus, ~200,000 GPUs)
MAX_GPUS_PER_NODE = 1 << 10  # 1,024: the largest NVLink domain announced is 576 (NVL576)
MAX_ELEMENTS = 1 << 40  # one layer's parameters, one embedding table, one global batch's tokens or values
MAX_LAYERS = 1 << 14  # 16,384 blocks: 16x the deepest transformer trained (DeepNet's 1,000)
MAX_EXPERTS = 1 << 14  # 16,384 experts per layer: 64x DeepSeek-V3's 256 routed ones
MAX_EXPERT_MLPS = 1 << 20  # layers x experts: the declaration lists every expert tensor of a stage
MAX_SAMPLES = 1 << 32  # a global batch of 4.3e9 samples: 65,000x the largest image batches trained (64k)
MAX_PARAMS = 1 << 50  # 1.1e15 parameters: a thousand times the largest model trained
MAX_TOKENS = 1 << 60  # 1.2e18 training tokens: 30,000x the largest corpus trained on (Qwen3: 36T)
MAX_MEMORY_GB = 1e6  # a petabyte on one device
MAX_TFLOPS = 1e6  # an exaFLOP/s on one device
MAX_HOURS = 1e9  # 114,000 years between failures of one GPU
MAX_GBPS = 1e9  # checkpoint bandwidth: an exabyte per second


def _shown(value: float) -> str:
    return f"{value:,}" if isinstance(value, int) else f"{value:g}"


def check_number(flag: str, value: float, maximum: float, *, hint: str = "") -> None:
    """A positive finite number no larger than ``maximum``; UserError naming ``flag`` otherwise
    (NaN fails every comparison: ``not value > 0`` catches it)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UserError(f"{flag} {value!r} is not a number")
    if math.isnan(value):
        raise UserError(f"{flag} is NaN, not a number; give a positive number")
    if not value > 0:
        raise UserError(f"{flag} must be positive, got {_shown(value)}")
    if math.isinf(value):
        raise UserError(f"{flag} is infinite; give a number of at most {_shown(maximum)}")
    if value > maximum:
        raise UserError(f"{flag} {_shown(value)} is beyond any real job (at most {_shown(maximum)})"
                        + (f"; hint: {hint}" if hint else ""))


def check_world(world: int, per_node: int, where: str) -> None:
    """A world of GPUs a machine can have: at most :data:`MAX_GPUS` in all, :data:`MAX_GPUS_PER_NODE` a node."""
    if world > MAX_GPUS:
        raise UserError(f"{where}: {world:,} GPUs is more than any machine has (at most {MAX_GPUS:,})")
    if per_node > MAX_GPUS_PER_NODE:
        raise UserError(f"{where}: {per_node:,} GPUs per node is more than any node has (at most "
                        f"{MAX_GPUS_PER_NODE:,})")


def check_dims(dims: dict[str, object], where: str = "") -> None:
    """A shape's integers, before a :class:`TransformerShape` is built of them (its checks divide by
    some): whole, positive, and within the limits. ``dims`` maps each flag or key to its value."""
    prefix = f"{where}: " if where else ""
    for flag, value in dims.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise UserError(f"{prefix}{flag} is {value!r}, expected a positive integer")
        limit = MAX_LAYERS if "layer" in flag else MAX_EXPERTS if "expert" in flag else MAX_ELEMENTS
        if value <= 0:
            raise UserError(f"{prefix}{flag} must be a positive integer, got {value}")
        if value > limit:
            raise UserError(f"{prefix}{flag} {value:,} is beyond any real model (at most {limit:,})")


def check_shape(shape: TransformerShape, where: str = "") -> None:
    """A shape whose layers and tables hold at most 2^40 elements each and whose total is a model's."""
    prefix = f"{where}: " if where else ""
    check_dims({"layers": shape.layers, "hidden": shape.hidden, "heads": shape.heads, "kv_heads": shape.kv,
                "head_dim": shape.head_size, "ffn_hidden": shape.ffn, "seq_len": shape.seq_len, "vocab": shape.vocab,
                "experts": shape.experts, "top_k": shape.top_k}, where)
    parts = {"one block's parameters": shape.layer_params, "the embedding table": shape.embedding_params}
    for what, elements in parts.items():
        if elements > MAX_ELEMENTS:
            raise UserError(f"{prefix}{what} come to {elements:,} elements, beyond any real model (at most "
                            f"2^40 = {MAX_ELEMENTS:,})")
    if shape.experts > 1 and shape.layers * shape.experts > MAX_EXPERT_MLPS:
        raise UserError(f"{prefix}{shape.layers:,} layers x {shape.experts:,} experts is beyond any real model "
                        f"(at most {MAX_EXPERT_MLPS:,} expert MLPs)")
    if shape.params > MAX_PARAMS:
        raise UserError(f"{prefix}{shape.params:,} parameters is beyond any real model (at most {MAX_PARAMS:,})")


def check_batch(samples: int, elements_per_sample: int, where: str) -> None:
    """A global batch of at most 2^32 samples and 2^40 elements (tokens for a language model, input
    values otherwise)."""
    if samples > MAX_SAMPLES:
        raise UserError(f"{where}: a global batch of {samples:,} samples is beyond any real job (at most "
                        f"2^32 = {MAX_SAMPLES:,})")
    if samples * max(1, elements_per_sample) > MAX_ELEMENTS:
        per = f" x {elements_per_sample:,} elements per sample" if elements_per_sample > 1 else ""
        raise UserError(f"{where}: a global batch of {samples:,} samples{per} is beyond any real job (at most "
                        f"2^40 = {MAX_ELEMENTS:,} elements a step)")
