"""Activation memory per GPU: Korthikanti et al. 2022 for transformers (any other model is
measured by a meta-device forward, :func:`hpctrain.telemetry.measure.saved_tensor_bytes`).

Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models" (2022),
count the bytes one transformer layer keeps for backward, with e-byte activations and
1-byte dropout masks (e = 2 gives the paper's s·b·h·(34 + 5·a·s/h)):

- replicated under tensor parallelism: layer-norm inputs 2e, QKV and MLP inputs 2e,
  two dropout masks 2  ->  (4e + 2)·sbh
- split by tensor parallelism: Q, K, V 3e, projection input e, GeLU input and output 8e
  ->  12e·sbh
- attention scores (softmax output, its dropout mask, dropout output): (2e + 1)·a·s²·b

Tensor parallelism (t) divides the split part and the scores; sequence parallelism also
divides the replicated part. Context parallelism (c, hpctrain's all-gather-KV attention) divides
every term by c (a rank computes s/c tokens) except the keys and values attention saves, which
are gathered whole (2e·s·b·kv_dim), plus one additive mask (e·(s/c)·s) per micro-batch.
Selective recompute drops the scores; full recompute keeps only each layer's input (e·sbh, /t
under sequence parallelism) plus one layer's full set while it is recomputed. With a 1F1B
pipeline the first stage holds p micro-batches of L/p layers: L layers' worth, whatever p is.
With uneven stages each stage is counted on its own (stage i holds p - i micro-batches of its
layers) and the largest is the peak.
"""

from __future__ import annotations

from hpctrain.core.errors import UserError
from hpctrain.models.shape import TransformerShape, stage_blocks

RECOMPUTE = ("none", "selective", "full")


def layer_bytes(shape: TransformerShape, micro_batch: int, *, tp: int = 1, sequence_parallel: bool = False,
                recompute: str = "none", element_bytes: int = 2, dropout: bool | None = None, cp: int = 1,
                dense: bool = False) -> float:
    """Bytes one layer keeps for backward on one GPU (Korthikanti et al. 2022, table 2).

    ``dropout`` None follows the shape's. Beyond the paper's GPT: K and V are kv_dim wide
    (grouped-query attention; MLA's up-projected per-head K and V, and its latents); the MLP keeps
    2 tensors of its width (GeLU input and output) or 4 for SwiGLU (gate, silu(gate), up, their
    product: what eager PyTorch saves), times top_k + shared experts for a mixture (each token passes
    through them); ``dense``: one of a mixture's leading dense blocks (one MLP of ``dense_ffn``)."""
    if recompute not in RECOMPUTE:
        raise UserError(f"--activation-checkpointing {recompute!r} is not one of {', '.join(RECOMPUTE)}")
    dropout = shape.dropout if dropout is None else dropout
    e, mask = element_bytes, (1 if dropout else 0)
    sb = shape.seq_len * micro_batch / cp  # context parallel: a rank computes s/cp of the tokens
    sbh = sb * shape.hidden
    replicated_divisor = tp if sequence_parallel else 1
    if recompute == "full":
        return e * sbh / replicated_divisor
    # eager torch.nn.RMSNorm keeps its normalized output as well as its input (LayerNorm's fused kernel only the input)
    norm_outputs = 2 * e if shape.norm == "rmsnorm" else 0
    # MLA's latents (the down-projections' outputs, whole on every tp rank) beside the block's inputs
    replicated = (4 * e + 2 * mask + norm_outputs) * sbh / replicated_divisor + e * sb * shape.mla_latent
    # Q, K, V, projection input (q_dim: heads x head_dim); under cp, K and V gathered whole
    q, k, v, o = shape.attention_widths
    attention = e * sb * (q + o) + e * sb * cp * (k + v)
    split = (attention + e * sb * mlp_width(shape, dense) * (4 if shape.mlp == "swiglu" else 2)) / tp
    if recompute == "selective":
        return replicated + split
    # without dropout the softmax output is the only score tensor (no mask, no second copy)
    per_score = (2 * e + 1) if dropout else e
    scores = per_score * shape.heads * shape.seq_len ** 2 * micro_batch / cp
    return replicated + split + scores / tp


def mlp_width(shape: TransformerShape, dense: bool = False) -> int:
    """The MLP width a token's activations span in one block: a dense block's, or a mixture's top_k +
    shared experts of ffn each."""
    if dense:
        return shape.dense_ffn or shape.ffn
    return shape.ffn * (shape.top_k + shape.shared_experts)


def stage_bytes(shape: TransformerShape, micro_batch: int, *, tp: int = 1, pp: int = 1,
                sequence_parallel: bool = False, recompute: str = "none", element_bytes: int = 2,
                dropout: bool | None = None, cp: int = 1) -> list[float]:
    """Peak activation bytes on each pipeline stage for one micro-batch size. Under 1F1B
    stage i holds pp - i micro-batches of its own layers (the first holds pp, the last one),
    so with even stages the first holds L layers' worth whatever pp is."""
    kw = dict(tp=tp, sequence_parallel=sequence_parallel, element_bytes=element_bytes, dropout=dropout, cp=cp)
    one = {d: layer_bytes(shape, micro_batch, recompute=recompute, dense=d, **kw)  # type: ignore[arg-type]
           for d in (False, True)}
    # the layer being recomputed holds its full set during its backward
    full = {d: layer_bytes(shape, micro_batch, recompute="none", dense=d, **kw)  # type: ignore[arg-type]
            for d in (False, True)}
    dropout = shape.dropout if dropout is None else dropout
    out = []
    for i, blocks in enumerate(stage_blocks(shape.layers, pp)):
        dense = sum(1 for b in blocks if shape.is_dense_block(b))
        kinds = ([True] if dense else []) + ([False] if dense < len(blocks) else [])
        recomputing = max(full[d] for d in kinds) if recompute == "full" else 0.0
        held = (len(blocks) - dense) * one[False] + (dense * one[True] if dense else 0.0)
        out.append((pp - i) * held + recomputing
                   + _ends_bytes(shape, micro_batch, tp=tp, pp=pp, stage=i, element_bytes=element_bytes,
                                 dropout=dropout, cp=cp))
    return out


def transformer_bytes(shape: TransformerShape, micro_batch: int, *, tp: int = 1, pp: int = 1,
                      sequence_parallel: bool = False, recompute: str = "none", element_bytes: int = 2,
                      dropout: bool | None = None, cp: int = 1) -> float:
    """Peak activation bytes on the busiest GPU (with even stages, the first) for one micro-batch."""
    return max(stage_bytes(shape, micro_batch, tp=tp, pp=pp, sequence_parallel=sequence_parallel,
                           recompute=recompute, element_bytes=element_bytes, dropout=dropout, cp=cp))


def _ends_bytes(shape: TransformerShape, micro_batch: int, *, tp: int, pp: int, stage: int, element_bytes: int,
                dropout: bool, cp: int = 1) -> float:
    """The first stage: the embedding dropout mask (pp micro-batches in flight). The last: the
    final norm and projection inputs (2e·sbh) and fp32 logits (4·sbV) of one micro-batch."""
    sbh = shape.seq_len * micro_batch * shape.hidden / cp
    total = (sbh * pp if dropout and stage == 0 else 0) / tp
    if stage == pp - 1:
        total += (2 * element_bytes * sbh + 4 * shape.seq_len * micro_batch * shape.vocab / cp) / tp
    if cp > 1 and stage == 0:  # the causal mask of this rank's queries over the gathered keys, shared by the layers
        total += element_bytes * shape.seq_len ** 2 / cp
    return total
