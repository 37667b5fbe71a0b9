"""Each strategy's memory, declared once: per-rank bytes of weights, gradients, optimizer state,
gathered (transient) parameters, what a pipeline stage holds across micro-batches, and
activations, as a function of the run layout (:class:`hpctrain.core.topology.Topology`), the
precision, accumulation, offload, activation checkpointing and the model's shape.

``hpctrain estimate``, the planner (``parallel.strategy=auto``, ``hpctrain plan``) and the run's
own ``summary.json`` (``memory_breakdown``'s ``predicted``) all read :func:`strategy_memory`;
tests/estimate/test_strategy_memory_declared.py holds it to what the trainer's tensors measure.
Torch-free, so a login node can plan. What each strategy holds, per rank (N = the stage's
parameters this rank's tensor-parallel slice holds, d = its sharding degree):

- ddp: N weights, N gradients (bucket views: no second copy), N optimizer state.
- zero1 (and DeepSpeed stage 1): the optimizer state (and DeepSpeed's fp32 master copy) / d.
- fsdp, hsdp (FSDP2, d = ``dp_shard``): weights, gradients and optimizer state / d; gathered, the
  root's own parameters (embedding, head: kept whole from forward to backward) and the two
  blocks in flight (the one computing and the one prefetched) plus one block's whole gradients
  before its reduce-scatter. ``reduce_every_microstep=false`` with accumulation: whole gradients
  (every inner micro-step accumulates them unsharded, in the reduce dtype). CPU offload: the
  sharded state lives in host memory (``offloaded``), only the gathered blocks on the device.
- pp x fsdp/hsdp: torch's pipeline schedules keep a stage's parameters gathered and its gradients
  whole between the micro-batches of a step (no reshard, no reduce-scatter until the last
  backward): ``pipeline_held`` = the stage's parameters in the gathered dtype plus its gradients
  in the reduce dtype; the shards of the gradients coexist with them only under accumulation.
- DeepSpeed: weights in the compute dtype, fp32 master partition + moments / d; stage 2 also the
  gradients / d, stage 3 the weights / d (plus the tensors under its persistence threshold, whole
  on every rank, and two blocks gathered in flight).
- Tensor parallelism splits every matrix of a block (norms and row-parallel biases replicated),
  and the embedding and head when the family splits the vocabulary (``vocab_parallel``).

Activations follow Korthikanti et al. 2022 (:mod:`hpctrain.estimate.activations`) with the
attention kernel named: ``flash`` (memory-efficient and flash attention, CUDA's SDPA) saves no
s x s scores; ``math`` (CPU, meta) does. A pipeline stage holds the micro-batches its schedule
has in flight (1F1B: pp - stage of them, at most ``microbatches``; GPipe: all). Full recompute
keeps each block's input; the block being recomputed is ``recomputed`` (not a saved tensor).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import TYPE_CHECKING

from hpctrain.core.errors import UserError
from hpctrain.core.topology import Topology
from hpctrain.estimate import activations
from hpctrain.estimate.activations import mlp_width
from hpctrain.estimate.gpu_memory import PREFETCHED_LAYERS
from hpctrain.models.shape import TransformerShape, stage_blocks, stage_layers

if TYPE_CHECKING:
    from hpctrain.config import Config

STRATEGIES = ("ddp", "zero1", "fsdp", "hsdp", "deepspeed")
# selective: hpctrain's policy (every matmul's and attention's output kept); selective_op: torchtitan's op-level
# policy (every other matmul's output recomputed); full: each block's input alone
RECOMPUTE = ("none", "selective", "selective_op", "full")
ATTENTION = ("flash", "math")
AMP_LAYOUTS = ("autocast", "master", "megatron")
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
PRECISION_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 2}  # fp8 activations counted as 16-bit
DS_PERSISTENCE = 100_000  # DeepSpeed ZeRO-3 keeps tensors under this many elements whole on every rank
_CONFIG_RECOMPUTE = {"none": "none", "block": "full", "selective": "selective", "full": "full"}


@dataclass(frozen=True, kw_only=True)
class MemoryInputs:
    """What one rank's memory depends on. Counts are elements; the result is bytes."""

    shape: TransformerShape  # shape.seq_len: the trained sequence length
    topology: Topology
    strategy: str = "ddp"
    deepspeed_stage: int = 2
    precision: str = "bf16"
    amp_layout: str = "autocast"  # autocast: hpctrain's trainer (fp32 params+grads); master; megatron
    param_dtype_bytes: int | None = None  # fsdp/hsdp gathered parameters; None: the compute dtype's
    reduce_dtype_bytes: int = 4  # fsdp/hsdp whole gradients between reduce-scatters (parallel.reduce_dtype)
    optimizer_elements: float = 2.0  # fp32 state per parameter: Adam(W) 2, SGD with momentum 1, SGD 0
    micro_batch: int = 1  # samples per forward on one rank (per pipeline micro-batch under pp)
    grad_accum: int = 1
    reduce_every_microstep: bool = True
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    recompute: str = "none"
    sequence_parallel: bool = False
    microbatches: int = 1  # pp > 1: pipeline micro-batches per step
    pp_schedule: str = "1f1b"
    attention: str = "flash"
    params: float | None = None  # a built model's measured count: the state bytes scale by params / shape.params
    vocab_parallel: bool = True  # tp splits the embedding and head by vocabulary rows (llama, Megatron, torchtitan)
    loss_parallel: bool = False  # tp splits the logits and the loss too (Megatron, torchtitan); hpctrain gathers them


@dataclass(frozen=True)
class StrategyMemory:
    """Bytes on one rank (one pipeline stage's rank)."""

    weights: float
    gradients: float
    optimizer: float
    gathered: float
    pipeline_held: float
    activations: float
    transient: float = 0.0  # the loss's fp32 gradient buffers at the start of backward
    offloaded: float = 0.0  # host memory under cpu_offload: not part of total
    stage: int = 0
    pipeline_grads: float = 0.0  # the gradients' part of pipeline_held (the rest: gathered parameters)
    recomputed: float = 0.0  # full recompute: the block rebuilt during its backward (not a saved tensor)

    @property
    def states(self) -> float:
        return self.weights + self.gradients + self.optimizer

    @property
    def total(self) -> float:
        return (self.states + self.gathered + self.pipeline_held + self.activations + self.transient
                + self.recomputed)

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "states": self.states, "total": self.total}


def recompute_of(activation_checkpointing: str) -> str:
    """``parallel.activation_checkpointing`` (none | block | selective) as :data:`RECOMPUTE`."""
    if activation_checkpointing not in _CONFIG_RECOMPUTE:
        raise UserError(f"activation checkpointing {activation_checkpointing!r} is not one of "
                        f"{', '.join(_CONFIG_RECOMPUTE)}")
    return _CONFIG_RECOMPUTE[activation_checkpointing]


def check_inputs(inp: MemoryInputs) -> None:
    for name, value, allowed in (("strategy", inp.strategy, STRATEGIES), ("recompute", inp.recompute, RECOMPUTE),
                                 ("attention", inp.attention, ATTENTION), ("amp_layout", inp.amp_layout, AMP_LAYOUTS),
                                 ("precision", inp.precision, tuple(PRECISION_BYTES)),
                                 ("pp_schedule", inp.pp_schedule, SCHEDULES)):
        if value not in allowed:
            raise UserError(f"{name} {value!r} is not one of {', '.join(allowed)}")
    if inp.deepspeed_stage not in (1, 2, 3):
        raise UserError(f"deepspeed_stage {inp.deepspeed_stage} must be 1, 2 or 3")
    for name in ("micro_batch", "grad_accum", "microbatches"):
        if getattr(inp, name) < 1:
            raise UserError(f"{name} must be at least 1, got {getattr(inp, name)}")
    if inp.shape.heads % inp.topology.tp:
        raise UserError(f"tp {inp.topology.tp} must divide the {inp.shape.heads} heads")
    stage_layers(inp.shape.layers, inp.topology.pp)


# ---------------------------------------------------------------- parameters a rank holds


@dataclass(frozen=True)
class _Held:
    """One stage's parameters on one tensor-parallel (and expert-parallel) rank, in elements: the
    blocks' (their routed experts among them), the rest's (embedding, final norm, head: FSDP's root),
    the largest block's, and the tensors' sizes (DeepSpeed)."""

    blocks: float
    root: float
    layer: float
    layers: int
    tensors: tuple[float, ...]
    experts: float = 0.0  # of ``blocks``: the routed experts this ep rank holds (sharded over dp / ep)

    @property
    def total(self) -> float:
        return self.blocks + self.root


def _attention_tensors(shape: TransformerShape, tp: int) -> list[float]:
    """One block's attention on a tp rank: its matrices split by heads, MLA's down-projections and
    latent norms whole (as torchtitan's MLA plan keeps them), a per-head q/k norm whole."""
    h = shape.hidden
    per_norm = 2 if shape.norm == "layernorm" else 1
    if shape.mla:
        down = [float(h * shape.q_lora_rank), float(per_norm * shape.q_lora_rank)] if shape.q_lora_rank else []
        q_up = shape.q_lora_rank or h
        return down + [q_up * shape.qk_dim / tp, float(h * (shape.kv_lora_rank + shape.qk_rope_dim)),
                       float(per_norm * shape.kv_lora_rank), shape.kv_lora_rank * (shape.q_dim + shape.v_dim) / tp,
                       shape.v_dim * h / tp]
    q, kv = shape.q_dim, shape.kv_dim
    tensors = [h * q / tp, h * kv / tp, h * kv / tp, q * h / tp]
    if shape.bias in ("all", "qkv"):
        tensors += [q / tp, kv / tp, kv / tp]
    if shape.bias == "all":
        tensors.append(float(h))
    if shape.qk_norm:
        tensors += [float(per_norm * shape.head_size)] * 2
    return tensors


def _mlp_tensors(shape: TransformerShape, width: int, tp: int) -> list[float]:
    """One MLP of ``width`` on a tp rank: up (and gate) column-parallel, down row-parallel (its bias whole)."""
    h = shape.hidden
    tensors = [h * width / tp] * (shape.mlp_matrices - 1) + [width * h / tp]
    if shape.bias == "all":
        tensors += [width / tp] * (shape.mlp_matrices - 1) + [float(h)]
    return tensors


def _layer_tensors(shape: TransformerShape, tp: int, dense: bool = False, ep: int = 1) -> tuple[list[float], int]:
    """One block's parameter tensors on a tp x ep rank, and how many of them (at the end) are routed
    experts: matrices (and column-parallel biases) split by tp, norms and row-parallel biases whole;
    a mixture's router and shared experts on every ep rank, its routed experts 1/ep of them each."""
    h = shape.hidden
    norm = shape.norm_params // 2 if shape.norm == "layernorm" else shape.norm_params
    norms = [float(norm)] * (shape.block_norms * (2 if shape.norm == "layernorm" else 1))
    tensors = _attention_tensors(shape, tp) + norms
    if dense or not shape.moe:
        return tensors + _mlp_tensors(shape, shape.dense_ffn or shape.ffn if dense else shape.ffn, tp), 0
    tensors += [float(h * shape.experts)] + _mlp_tensors(shape, shape.ffn, tp) * shape.shared_experts
    routed = _mlp_tensors(shape, shape.ffn, tp) * (shape.experts // ep)
    return tensors + routed, len(routed)


def _held(inp: MemoryInputs, stage: int) -> _Held:
    shape, tp, pp, ep = inp.shape, inp.topology.tp, inp.topology.pp, inp.topology.ep
    blocks = stage_blocks(shape.layers, pp)[stage]
    kinds = {d: _layer_tensors(shape, tp, d, ep) for d in {shape.is_dense_block(b) for b in blocks}}
    vocab_split = tp if inp.vocab_parallel else 1
    root: list[float] = []
    if stage == 0:
        root.append(shape.vocab * shape.hidden / vocab_split)
        if shape.positions == "learned":
            root.append(float((shape.max_positions or shape.seq_len) * shape.hidden))
    if stage == pp - 1:
        root.append(float(shape.norm_params))
        if not shape.tied or pp > 1:  # a tied head shares the embedding; split stages each hold one
            root.append(shape.vocab * shape.hidden / vocab_split)
    scale = 1.0 if inp.params is None else inp.params / shape.params
    per_block = [kinds[shape.is_dense_block(b)] for b in blocks]
    sizes = [sum(tensors) * scale for tensors, _ in per_block]
    experts = sum(sum(tensors[len(tensors) - routed:]) for tensors, routed in per_block if routed) * scale
    tensors = tuple(t * scale for block, _ in per_block for t in block) + tuple(r * scale for r in root)
    return _Held(blocks=sum(sizes), root=sum(root) * scale, layer=max(sizes), layers=len(blocks), tensors=tensors,
                 experts=experts)


# ---------------------------------------------------------------- bytes per element


@dataclass(frozen=True)
class _Bytes:
    weights: float
    grads: float
    master: float  # an fp32 copy the optimizer steps (16-bit weights), 0 when the weights are it
    compute: int  # activations, gathered parameters
    reduce: int  # whole gradients FSDP accumulates (its reduce dtype, fp32)


def _bytes(inp: MemoryInputs) -> _Bytes:
    e = PRECISION_BYTES[inp.precision]
    gathered = inp.param_dtype_bytes or e
    if e == 4:
        master = 4.0 if inp.strategy == "deepspeed" else 0.0  # DeepSpeed's fp32 partition, a copy even in fp32
        return _Bytes(4, 4, master, 4, inp.reduce_dtype_bytes)
    if inp.strategy == "deepspeed" or inp.amp_layout == "master":
        return _Bytes(e, e, 4, e, inp.reduce_dtype_bytes)
    if inp.amp_layout == "megatron":
        return _Bytes(e, 4, 4, e, inp.reduce_dtype_bytes)
    return _Bytes(4, 4, 0, gathered, inp.reduce_dtype_bytes)  # autocast: fp32 parameters and gradients


# ---------------------------------------------------------------- the declaration


def stage_memory(inp: MemoryInputs) -> list[StrategyMemory]:
    """One rank's bytes on each pipeline stage, in order."""
    check_inputs(inp)
    return [_stage(inp, i) for i in range(inp.topology.pp)]


def strategy_memory(inp: MemoryInputs) -> StrategyMemory:
    """The busiest pipeline stage's rank: what every rank must fit."""
    return max(stage_memory(inp), key=lambda m: m.total)


def _shards(inp: MemoryInputs) -> dict[str, int]:
    """Over how many ranks each of weights, gradients and optimizer state is split."""
    topo, s = inp.topology, inp.strategy
    if s in ("fsdp", "hsdp"):  # context parallel: FSDP shards over dp_shard x cp (as torchtitan)
        d = topo.dp_shard * topo.cp
        return {"weights": d, "grads": d, "optimizer": d}
    if s == "zero1":  # the optimizer state split over every rank that holds the same weights
        return {"weights": 1, "grads": 1, "optimizer": topo.dp_cp}
    if s == "deepspeed":
        k = inp.deepspeed_stage
        return {"weights": topo.dp if k == 3 else 1, "grads": topo.dp if k >= 2 else 1, "optimizer": topo.dp}
    return {"weights": 1, "grads": 1, "optimizer": 1}


def _sharded(held: _Held, degree: int, ep: int) -> float:
    """Elements one rank keeps of ``held`` split over ``degree`` ranks: the routed experts only over
    the degree / ep of them that hold the same experts (expert parallelism takes its ranks from the
    data-parallel ones), everything else over all ``degree``."""
    return (held.total - held.experts) / degree + held.experts / max(1, degree // ep)


def _stage(inp: MemoryInputs, stage: int) -> StrategyMemory:
    held, b, d, ep = _held(inp, stage), _bytes(inp), _shards(inp), inp.topology.ep
    n = held.total
    weights = _sharded(held, d["weights"], ep) * b.weights
    grads = _sharded(held, d["grads"], ep) * b.grads
    optimizer = _sharded(held, d["optimizer"], ep) * (b.master + 4 * inp.optimizer_elements)
    gathered = pipeline = pipeline_grads = offloaded = 0.0
    sharded = inp.strategy in ("fsdp", "hsdp") and inp.topology.dp_shard * inp.topology.cp > 1
    if inp.strategy == "deepspeed":
        # fp32 partition's
        grads += _sharded(held, inp.topology.dp, ep) * 4 if inp.deepspeed_stage == 1 and b.master else 0.0
        if inp.deepspeed_stage == 3:
            weights += sum(t for t in held.tensors if t < DS_PERSISTENCE) * b.weights
            gathered = min(PREFETCHED_LAYERS, held.layers) * held.layer * b.compute
    elif sharded:
        if inp.topology.pp > 1 and inp.microbatches > 1:
            # the schedule keeps the stage gathered, its gradients whole, until the last micro-batch
            pipeline_grads = n * b.reduce
            pipeline = n * b.compute + pipeline_grads
            grads = grads if inp.grad_accum > 1 else 0.0  # earlier micro-steps' shards, beside the whole ones
        else:
            gathered = _fsdp_gathered(inp, held, b)
            if inp.grad_accum > 1 and not inp.reduce_every_microstep:
                grads = n * b.reduce  # whole, accumulated over the inner micro-steps
        if inp.cpu_offload:
            offloaded, weights, grads, optimizer = weights + grads + optimizer, 0.0, 0.0, 0.0
    acts, recomputed, transient = _activations(inp, stage)
    return StrategyMemory(weights, grads, optimizer, gathered, pipeline, acts, transient, offloaded, stage,
                          pipeline_grads, recomputed)


def _fsdp_gathered(inp: MemoryInputs, held: _Held, b: _Bytes) -> float:
    """The root's parameters (whole from forward to backward), the blocks in flight (all of them
    without resharding after forward) and one block's whole gradients before its reduce-scatter."""
    blocks = held.layers if not inp.reshard_after_forward else min(PREFETCHED_LAYERS, held.layers)
    return (held.root + blocks * held.layer) * b.compute + held.layer * b.reduce


# ---------------------------------------------------------------- activations


def in_flight(inp: MemoryInputs, stage: int) -> int:
    """Micro-batches whose activations stage ``stage`` holds at its peak."""
    pp = inp.topology.pp
    if pp == 1:
        return 1
    if inp.pp_schedule == "gpipe":
        return inp.microbatches
    return min(pp - stage, inp.microbatches)


def _activations(inp: MemoryInputs, stage: int) -> tuple[float, float, float]:
    """(saved for backward at the peak, the block being recomputed, buffers outside autograd) on a
    rank of ``stage``."""
    shape, topo = inp.shape, inp.topology
    e = PRECISION_BYTES[inp.precision]
    # context parallel: a rank holds seq_len / cp of the tokens (the gathered K/V: activations.layer_bytes)
    sbh = shape.seq_len * inp.micro_batch * shape.hidden / topo.cp
    # sequence parallelism with DTensor (hpctrain, torchtitan): the column-parallel matmuls of attention and
    # the MLP save their all-gathered input whole, where Megatron re-gathers it in backward
    gathered = 2 * e * sbh * (1 - 1 / topo.tp) if inp.sequence_parallel else 0.0
    kw = dict(tp=topo.tp, sequence_parallel=inp.sequence_parallel, element_bytes=e, cp=topo.cp)
    blocks = stage_blocks(shape.layers, topo.pp)[stage]
    dense = sum(1 for b in blocks if shape.is_dense_block(b))
    kinds = {d: n for d, n in ((True, dense), (False, len(blocks) - dense)) if n}
    # flash attention saves no scores: the bytes of Korthikanti's selective recompute
    whole = {d: activations.layer_bytes(shape, inp.micro_batch, recompute="selective" if inp.attention == "flash"
                                        else "none", dense=d, **kw) + gathered  # type: ignore[arg-type]
             for d in kinds}
    if inp.recompute in ("selective", "selective_op"):
        layer = {d: _kept_outputs(inp, every_other=inp.recompute == "selective_op", dense=d) for d in kinds}
    elif inp.recompute == "full":
        layer = {d: activations.layer_bytes(shape, inp.micro_batch, recompute="full", dense=d, **kw)  # type: ignore[arg-type]
                 for d in kinds}
    else:
        layer = whole
    flight = in_flight(inp, stage)
    held = flight * sum(n * layer[d] for d, n in kinds.items())
    sbv = shape.seq_len * inp.micro_batch * shape.vocab / (topo.tp if inp.loss_parallel else 1) / topo.cp
    last = stage == topo.pp - 1
    if last:  # the final norm's input and output (eager RMSNorm: its normalized input too), fp32 log-softmax
        norm = 3 if shape.norm == "rmsnorm" else 2
        held += norm * e * sbh / (topo.tp if inp.sequence_parallel else 1) + 4 * sbv
    recomputed = max(whole.values()) if inp.recompute != "none" else 0.0
    # the loss's two fp32 gradient buffers; a stage's received inputs and sent outputs of the
    # micro-batches in flight (the schedule's buffers, not tensors saved for backward)
    boundary = flight * e * sbh * ((stage > 0) + (not last))
    return held, recomputed, (8 * sbv if last else 0.0) + boundary


def _kept_outputs(inp: MemoryInputs, *, every_other: bool, dense: bool = False) -> float:
    """Selective recompute: a block keeps its input, its matmuls' outputs (all, or every other one
    in call order: q, k, v, o, the MLP's up matrices, down) and attention's output; the element-wise
    ops are recomputed. Column-parallel outputs are split by tp; the input and the row-parallel
    outputs (o, down: all-reduced whole) only under sequence parallelism."""
    shape, tp = inp.shape, inp.topology.tp
    rows = shape.seq_len * inp.micro_batch * PRECISION_BYTES[inp.precision] / inp.topology.cp
    h, up = shape.hidden, mlp_width(shape, dense)
    q, k, v, _ = shape.attention_widths
    matmuls = [(q, True), (k, True), (v, True), (h, False)]
    matmuls += [(up, True)] * (shape.mlp_matrices - 1) + [(h, False)]
    kept = matmuls[::2] if every_other else matmuls
    whole = h + sum(w for w, split in kept if not split)
    split = shape.v_dim + sum(w for w, split in kept if split)  # attention's output is split by head
    whole += shape.mla_latent  # MLA's latents: the down-projections' outputs, whole on every tp rank
    return rows * (split / tp + whole / (tp if inp.sequence_parallel else 1))


def with_changes(inp: MemoryInputs, **changes: object) -> MemoryInputs:
    """``inp`` with some fields replaced (a planner's variations), checked."""
    names = {f.name for f in fields(MemoryInputs)}
    unknown = set(changes) - names
    if unknown:
        raise TypeError(f"MemoryInputs has no field {', '.join(sorted(unknown))}")
    out = replace(inp, **changes)  # type: ignore[arg-type]
    check_inputs(out)
    return out


# ---------------------------------------------------------------- a run's own layout, and its measurement

def optimizer_elements(cfg: Config) -> float:
    """fp32 optimizer state per parameter, in parameter elements: Adam(W)'s two moments (also
    assumed for an optimizer of the user's), SGD's momentum, nothing for plain SGD."""
    if cfg.optim.name == "sgd":
        return 1.0 if cfg.optim.momentum else 0.0
    return 2.0


def inputs_from_config(cfg: Config, shape: TransformerShape, topology: Topology, *, micro_batch: int,
                       params: float | None = None, vocab_parallel: bool = True) -> MemoryInputs:
    """What a run of ``cfg`` declares on ``topology``: ``micro_batch`` samples per rank per
    micro-step (split into ``parallel.microbatches`` under pp), hpctrain's trainer's precision
    layout (fp32 parameters under autocast; DeepSpeed's own), PyTorch SDPA's memory-efficient
    attention (no score matrix, also on CPU), logits gathered whole for the loss."""
    p = cfg.parallel
    elements = optimizer_elements(cfg)
    gathered = {"fp32": 4, "bf16": 2, "fp16": 2}.get(p.param_dtype)
    micro = max(1, micro_batch // p.microbatches) if topology.pp > 1 else micro_batch
    return MemoryInputs(shape=shape, topology=topology, strategy=p.strategy, deepspeed_stage=p.deepspeed_stage,
                        precision=cfg.precision, amp_layout="autocast", param_dtype_bytes=gathered,
                        reduce_dtype_bytes=2 if p.reduce_dtype == "bf16" else 4, optimizer_elements=elements,
                        micro_batch=micro, grad_accum=cfg.train.grad_accum,
                        reduce_every_microstep=p.reduce_every_microstep, reshard_after_forward=p.reshard_after_forward,
                        cpu_offload=p.cpu_offload, recompute=recompute_of(p.activation_checkpointing),
                        sequence_parallel=p.sequence_parallel, microbatches=p.microbatches if topology.pp > 1 else 1,
                        pp_schedule=p.pp_schedule, attention="flash", params=params, vocab_parallel=vocab_parallel,
                        loss_parallel=False)


def as_measured(inp: MemoryInputs, stage: int) -> dict[str, float]:
    """The declaration of ``stage``'s rank under the names ``summary.json``'s ``memory_breakdown``
    measures (:mod:`hpctrain.telemetry.memory_breakdown`): its tensors wherever they live (offloaded
    ones too), a pipeline stage's whole gradients among the gradients and its gathered parameters
    among the gathered ones, activations as saved for backward (not the block being recomputed)."""
    m = _stage(replace(inp, cpu_offload=False), stage)
    return {"params_bytes": m.weights, "grads_bytes": m.gradients + m.pipeline_grads,
            "optimizer_bytes": m.optimizer, "gathered_bytes": m.gathered + m.pipeline_held - m.pipeline_grads,
            "activations_bytes": m.activations}


def with_predicted(rows: list[dict[str, int]], inp: MemoryInputs) -> list[dict[str, object]]:
    """``memory_breakdown``'s rows (one per rank, in rank order), each with ``predicted``: the
    declaration for that rank's pipeline stage, in the row's own keys (bytes, rounded)."""
    check_inputs(inp)
    per_stage = inp.topology.world // inp.topology.pp
    out: list[dict[str, object]] = []
    for row in rows:
        stage = min(int(row["rank"]) // per_stage, inp.topology.pp - 1)
        out.append({**row, "predicted": {k: round(v) for k, v in as_measured(inp, stage).items()}})
    return out


def run_breakdown(rows: list[dict[str, int]] | None, cfg: Config, model: object, topology: Topology, *,
                  micro_batch: int) -> dict[str, object]:
    """``summary.json``'s ``memory_breakdown`` with ``predicted`` beside each rank's measured row
    (``{}``: nothing measured, or a model without a transformer shape, or a strategy this module
    does not declare). ``model``: the rank's module (its family's shape, its vocabulary)."""
    from hpctrain.models.family import family_for  # torch: the model families, for a run that built one

    family = family_for(cfg.model)
    if not rows or family is None or family.shape is None or cfg.parallel.strategy not in STRATEGIES:
        return {}
    shape = family.shape(cfg.model)
    vocab = getattr(getattr(model, "shape", None), "vocab", None)  # the data's, when the config left it out
    if isinstance(vocab, int) and vocab != shape.vocab:
        shape = replace(shape, vocab=vocab)
    try:
        inp = inputs_from_config(cfg, shape, topology, micro_batch=micro_batch,
                                 vocab_parallel=bool(getattr(model, "vocab_parallel", False)))
        return {"memory_breakdown": with_predicted(rows, inp)}
    except UserError:  # a layout the declaration refuses: the measured rows alone
        return {}
