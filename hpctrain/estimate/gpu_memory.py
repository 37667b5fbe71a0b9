"""Memory per GPU by strategy: weights, gradients, optimizer state (Adam), gathered layers, activations.

Bytes per parameter (Rajbhandari et al. 2020, "ZeRO", section 3.1, K = 12 for Adam):

- ``master``: 16-bit weights and gradients, an fp32 master copy plus Adam m and v in the
  optimizer: 2 + 2 + 12 (the ZeRO paper's accounting; DeepSpeed's fp16/bf16 optimizer).
- ``megatron``: Megatron-LM in bf16 keeps fp32 main gradients (its gradient buffer
  accumulates and reduces in fp32): 2 + 4 + 12 = 18, or 6 + 12/dp with its distributed
  optimizer (the zero1 row).
- ``autocast``: PyTorch AMP keeps fp32 parameters and gradients and casts on the fly:
  4 + 4 + 8, the same 16 bytes split differently (what hpctrain's own trainer does).
- fp32 / tf32 training: 4 + 4 + 8.

ZeRO-1 shards the optimizer state over the data-parallel group, ZeRO-2 also the
gradients, ZeRO-3 and FSDP (full shard) also the weights. Tensor (t) and pipeline (p)
parallelism split the parameters first: each GPU holds N/(t·p) (with a shape, its pipeline
stage's own count), sharded over dp. Expert parallelism (ep) splits a mixture's experts
further, over ranks taken from the data-parallel group.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING

from hpctrain.core.errors import UserError
from hpctrain.estimate import activations
from hpctrain.models.shape import TransformerShape

if TYPE_CHECKING:
    from torch import nn

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp")
_SHARDED = {"ddp": set(), "zero1": {"optimizer"}, "zero2": {"optimizer", "grads"},
            "zero3": {"optimizer", "grads", "weights"}, "fsdp": {"optimizer", "grads", "weights"}}
PREFETCHED_LAYERS = 2  # ZeRO-3/FSDP hold the layer computing and the one prefetched unsharded


@dataclass(frozen=True)
class StateLayout:
    name: str
    weights: float  # bytes per parameter
    grads: float
    optimizer: float
    checkpoint: float  # bytes per parameter in a resumable checkpoint (no gradients)


MASTER = StateLayout("16-bit weights+grads, fp32 master+Adam m,v (2+2+12 B/param)", 2, 2, 12, 14)
MEGATRON = StateLayout("16-bit weights, fp32 main grads, fp32 master+Adam m,v (2+4+12 B/param)", 2, 4, 12, 14)
AUTOCAST = StateLayout("fp32 params+grads under autocast, Adam m,v (4+4+8 B/param)", 4, 4, 8, 12)
FP32 = StateLayout("fp32 weights+grads, Adam m,v (4+4+8 B/param)", 4, 4, 8, 12)


AMP_LAYOUTS = {"master": MASTER, "megatron": MEGATRON, "autocast": AUTOCAST}  # 16-bit training's state layouts


def layout_for(precision: str, amp_layout: str = "master") -> StateLayout:
    if precision in ("fp32", "tf32"):
        return FP32
    if amp_layout not in AMP_LAYOUTS:
        raise UserError(f"--amp-layout {amp_layout!r} is not one of {', '.join(AMP_LAYOUTS)}")
    return AMP_LAYOUTS[amp_layout]


def compute_bytes(precision: str) -> int:
    """Bytes of one activation / gathered weight element: fp8 is counted as 16-bit (conservative)."""
    return 4 if precision in ("fp32", "tf32") else 2


@dataclass(frozen=True)
class MemoryBreakdown:
    strategy: str
    weights: float
    grads: float
    optimizer: float
    gathered: float  # unsharded layers in flight (ZeRO-3/FSDP), known only for a transformer shape
    activations: float | None  # None: not estimable from a bare parameter count
    transient: float = 0.0  # buffers alive only at the start of backward (the loss's gradients)

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.gathered + (self.activations or 0.0) + self.transient

    def as_dict(self) -> dict[str, float | str | None]:
        return {**asdict(self), "total": self.total}


def check_strategy(strategy: str) -> str:
    if strategy not in STRATEGIES:
        raise UserError(f"--strategy {strategy!r} is not one of {', '.join(STRATEGIES)}")
    return strategy


def states_per_rank(params: float, layout: StateLayout, strategy: str, dp: int,
                    model_parallel: int = 1, *, expert_params: float = 0.0, ep: int = 1) -> tuple[float, float, float]:
    """(weights, grads, optimizer) bytes on one GPU. ``expert_params`` (part of ``params``) are
    split ``ep`` ways more by expert parallelism, which takes its ranks from the data-parallel
    group, so ZeRO shards them over the dp / ep ranks that hold the same experts."""
    dense = (params - expert_params) / model_parallel
    experts = expert_params / (model_parallel * ep)
    sharded = _SHARDED[check_strategy(strategy)]

    def part_bytes(part: str, per_param: float) -> float:
        if part not in sharded:
            return (dense + experts) * per_param
        return (dense / dp + experts / (dp // ep)) * per_param

    return (part_bytes("weights", layout.weights), part_bytes("grads", layout.grads),
            part_bytes("optimizer", layout.optimizer))


def gathered_bytes(strategy: str, shape: TransformerShape | None, element_bytes: int, tp: int = 1,
                   ep: int = 1) -> float:
    """Unsharded weights and their gradients of the layers in flight, in the compute dtype."""
    if "weights" not in _SHARDED[strategy] or shape is None:
        return 0.0
    layer = shape.layer_params - (shape.experts * shape.expert_params * (1 - 1 / ep) if shape.experts > 1 else 0)
    return PREFETCHED_LAYERS * layer / tp * element_bytes * 2


def per_rank(params: float, strategy: str, *, dp: int, tp: int = 1, pp: int = 1, layout: StateLayout,
             shape: TransformerShape | None = None, element_bytes: int = 2,
             activation_bytes: float | None = None, expert_params: float = 0.0, ep: int = 1) -> MemoryBreakdown:
    """One GPU's bytes; ``params`` are the model's (split by tp x pp here) or, with ``pp=1``, one
    pipeline stage's own."""
    weights, grads, optimizer = states_per_rank(params, layout, strategy, dp, tp * pp, expert_params=expert_params,
                                                ep=ep)
    return MemoryBreakdown(strategy, weights, grads, optimizer, gathered_bytes(strategy, shape, element_bytes, tp, ep),
                           activation_bytes)


def smallest_fit(breakdowns: dict[str, MemoryBreakdown], capacity_bytes: float) -> str | None:
    """The least sharding (ddp < zero1 < zero2 < zero3) whose total fits; fsdp equals zero3."""
    for name in ("ddp", "zero1", "zero2", "zero3"):
        if name in breakdowns and breakdowns[name].total <= capacity_bytes:
            return name
    return None


def predict_rank_bytes(model: nn.Module, strategy: str, world_size: int, *, precision: str = "bf16",
                       amp_layout: str = "autocast", shape: TransformerShape | None = None, micro_batch: int = 1,
                       recompute: str = "none", dropout: bool = False) -> MemoryBreakdown:
    """Predicted peak bytes on one data-parallel rank, for the benchmark that checks prediction
    against measured peak memory (FSDP/DDP runs of the GPT). ``model`` may live on any device,
    meta included; only its parameter count is read. Activations need ``shape``.

    Unlike the CLI's table this adds the loss's backward: cross-entropy on fp32 logits keeps
    its log-softmax (4sbV, already in the activations) and, at the start of backward, two
    more fp32 s x b x V gradients while every activation is still alive (8sbV)."""
    e = compute_bytes(precision)
    acts = None if shape is None else activations.transformer_bytes(
        shape, micro_batch, recompute=recompute, element_bytes=e, dropout=dropout)
    from hpctrain.telemetry.measure import param_count  # torch: only for a built model

    row = per_rank(param_count([model]), strategy, dp=world_size, layout=layout_for(precision, amp_layout),
                   shape=shape, element_bytes=e, activation_bytes=acts)
    loss_grads = 0.0 if shape is None else 8.0 * shape.seq_len * micro_batch * shape.vocab
    return replace(row, transient=loss_grads)
