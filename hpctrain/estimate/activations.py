"""Activation memory per GPU: Korthikanti et al. 2022 for transformers (any other model is
measured by a meta-device forward, :func:`hpctrain.estimate.measure.saved_tensor_bytes`).

Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models" (2022),
count the bytes one transformer layer keeps for backward, with e-byte activations and
1-byte dropout masks (e = 2 gives the paper's s·b·h·(34 + 5·a·s/h)):

- replicated under tensor parallelism: layer-norm inputs 2e, QKV and MLP inputs 2e,
  two dropout masks 2  ->  (4e + 2)·sbh
- split by tensor parallelism: Q, K, V 3e, projection input e, GeLU input and output 8e
  ->  12e·sbh
- attention scores (softmax output, its dropout mask, dropout output): (2e + 1)·a·s²·b

Tensor parallelism (t) divides the split part and the scores; sequence parallelism also
divides the replicated part. Selective recompute drops the scores; full recompute keeps
only each layer's input (e·sbh, /t under sequence parallelism) plus one layer's full set
while it is recomputed. With a 1F1B pipeline the first stage holds p micro-batches of L/p
layers: L layers' worth, whatever p is.
"""

from __future__ import annotations

from hpctrain.errors import UserError
from hpctrain.estimate.model import TransformerShape

RECOMPUTE = ("none", "selective", "full")


def layer_bytes(shape: TransformerShape, micro_batch: int, *, tp: int = 1, sequence_parallel: bool = False,
                recompute: str = "none", element_bytes: int = 2, dropout: bool = True) -> float:
    """Bytes one layer keeps for backward on one GPU (Korthikanti et al. 2022, table 2)."""
    if recompute not in RECOMPUTE:
        raise UserError(f"--activation-checkpointing {recompute!r} is not one of {', '.join(RECOMPUTE)}")
    e, mask = element_bytes, (1 if dropout else 0)
    sbh = shape.seq_len * micro_batch * shape.hidden
    replicated_divisor = tp if sequence_parallel else 1
    if recompute == "full":
        return e * sbh / replicated_divisor
    replicated = (4 * e + 2 * mask) * sbh / replicated_divisor
    split = 12 * e * sbh / tp
    if recompute == "selective":
        return replicated + split
    # without dropout the softmax output is the only score tensor (no mask, no second copy)
    per_score = (2 * e + 1) if dropout else e
    scores = per_score * shape.heads * shape.seq_len ** 2 * micro_batch
    return replicated + split + scores / tp


def transformer_bytes(shape: TransformerShape, micro_batch: int, *, tp: int = 1, pp: int = 1,
                      sequence_parallel: bool = False, recompute: str = "none", element_bytes: int = 2,
                      dropout: bool = True) -> float:
    """Peak activation bytes on the busiest GPU (the first pipeline stage) for one micro-batch."""
    kw = dict(tp=tp, sequence_parallel=sequence_parallel, element_bytes=element_bytes, dropout=dropout)
    total = shape.layers * layer_bytes(shape, micro_batch, recompute=recompute, **kw)  # type: ignore[arg-type]
    if recompute == "full":  # the layer being recomputed holds its full set during its backward
        total += layer_bytes(shape, micro_batch, recompute="none", **kw)  # type: ignore[arg-type]
    return total + _ends_bytes(shape, micro_batch, tp=tp, pp=pp, element_bytes=element_bytes, dropout=dropout)


def _ends_bytes(shape: TransformerShape, micro_batch: int, *, tp: int, pp: int, element_bytes: int,
                dropout: bool) -> float:
    """Embedding dropout mask (p micro-batches in flight on stage 0) and, without a pipeline, the
    output end on the same GPU: final norm and projection inputs (2e·sbh) and fp32 logits (4·sbV)."""
    sbh = shape.seq_len * micro_batch * shape.hidden
    total = (sbh * pp if dropout else 0) / tp
    if pp == 1:
        total += (2 * element_bytes * sbh + 4 * shape.seq_len * micro_batch * shape.vocab) / tp
    return total
