"""Training compute: 6ND FLOPs, model and hardware FLOPs, PF-days and wall time.

6ND (Kaplan et al. 2020): each parameter costs 2 FLOPs per token forward (multiply and
add) and 4 backward (gradients of inputs and of weights); N is what a token uses (a
mixture of experts' active parameters). It leaves out attention's score/value products,
which :func:`attention_flops` adds when the shape is known (12·L·h·s per token for
forward+backward, the PaLM appendix B convention, non-causal count): the model FLOPs of
MFU. Hardware FLOPs (HFU) also count what activation recomputation runs again.
6ND badly undercounts networks that reuse a weight at many positions (a convolution):
for a model built on the meta device, :func:`hpctrain.telemetry.measure.counted_per_sample` counts the real matmul
and convolution FLOPs of one forward+backward with ``torch.utils.flop_counter``.
"""

from __future__ import annotations

from hpctrain.models.shape import TransformerShape

PF_DAY = 1e15 * 86_400  # one PFLOP/s sustained for a day


def training_flops(params: float, tokens: float) -> float:
    return 6.0 * params * tokens


def attention_flops(shape: TransformerShape, tokens: float) -> float:
    """Score and value products, forward+backward: 3 x 2 FLOPs x s x (the query-key width + the value
    width) per layer and token: 12·s·heads·head_dim for ordinary attention (heads·head_dim is the hidden
    size unless a config's ``head_dim`` says otherwise); MLA's QK products are heads x (nope + rope)
    wide (DeepSeek-V3: 24,576) and its value products heads x v_head_dim (16,384). A local block
    (Gemma 2's sliding window) attends to min(s, window) keys."""
    return 6.0 * (shape.qk_dim + shape.v_dim) * shape.attention_span * tokens


def model_flops(shape: TransformerShape, tokens: float) -> float:
    """Forward+backward FLOPs the model needs, MFU's numerator (PaLM, appendix B): 6 x the
    parameters a token multiplies by (a mixture's active ones; not the input lookup tables, as
    torchtitan counts) plus attention."""
    return training_flops(shape.active_params - shape.lookup_params, tokens) + attention_flops(shape, tokens)


def recompute_flops(shape: TransformerShape | None, params: float, tokens: float, recompute: str) -> float:
    """FLOPs spent again by activation recomputation, which hardware FLOPs count and model FLOPs
    do not. Full: one more forward of every block (2 x block parameters + attention's 4sh per
    layer; the embedding and output layer are not recomputed), which makes Narayanan et al.'s 8ND.
    Selective: the attention core again (Korthikanti et al. 2022, 4sh per layer). Without a
    shape a full forward is taken as 2N."""
    if recompute == "none":
        return 0.0
    attention = attention_flops(shape, tokens) / 3 if shape is not None else 0.0
    if recompute == "selective":
        return attention
    blocks = params if shape is None else shape.active_blocks_params
    return 2.0 * blocks * tokens + attention


def pf_days(flops: float) -> float:
    return flops / PF_DAY


def wall_seconds(flops: float, gpus: int, peak_flops: float, mfu: float) -> float:
    """Time to do ``flops`` on ``gpus`` chips, each sustaining ``mfu`` of its dense peak."""
    return flops / (gpus * peak_flops * mfu)
