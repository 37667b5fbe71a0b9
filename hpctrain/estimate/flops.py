"""Training compute: 6ND FLOPs, PF-days and wall time at a given MFU.

6ND (Kaplan et al. 2020): each parameter costs 2 FLOPs per token forward (multiply and
add) and 4 backward (gradients of inputs and of weights). It leaves out attention's
score/value products, which :func:`attention_flops` adds when the shape is known (12·L·h·s
per token for forward+backward, the PaLM appendix B convention, non-causal count).
6ND badly undercounts networks that reuse a weight at many positions (a convolution):
for a model built on the meta device, :func:`hpctrain.estimate.measure.counted_per_sample` counts the real matmul
and convolution FLOPs of one forward+backward with ``torch.utils.flop_counter``.
"""

from __future__ import annotations

from hpctrain.estimate.model import TransformerShape

PF_DAY = 1e15 * 86_400  # one PFLOP/s sustained for a day


def training_flops(params: float, tokens: float) -> float:
    return 6.0 * params * tokens


def attention_flops(shape: TransformerShape, tokens: float) -> float:
    return 12.0 * shape.layers * shape.hidden * shape.seq_len * tokens


def pf_days(flops: float) -> float:
    return flops / PF_DAY


def wall_seconds(flops: float, gpus: int, peak_flops: float, mfu: float) -> float:
    """Time to do ``flops`` on ``gpus`` chips, each sustaining ``mfu`` of its dense peak."""
    return flops / (gpus * peak_flops * mfu)
