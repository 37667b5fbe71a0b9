"""One sizing estimate: validated inputs in, a JSON-ready dict out (the CLI only renders it)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from hpctrain.core.errors import UserError
from hpctrain.core.topology import Topology
from hpctrain.estimate import activations, bounds, flops, gpu_memory, reliability, strategy_memory
from hpctrain.models.shape import TransformerShape, stage_blocks, stage_layers, stage_params
from hpctrain.telemetry.accelerators import PRECISIONS, Accelerator

# --strategy names the table has no row for, that only the declaration sizes; and the table's ZeRO stages
DECLARED_ONLY = ("hsdp", "deepspeed")
_DECLARED = {"zero2": ("deepspeed", 2), "zero3": ("deepspeed", 3)}


@dataclass(frozen=True, kw_only=True)
class Inputs:
    params: float
    source: str  # how the parameter count was found, for the report
    gpu: Accelerator
    tokens: float | None = None
    gpus: int = 1
    strategy: str | None = None
    tp: int = 1
    pp: int = 1
    precision: str = "bf16"
    amp_layout: str = "master"
    mfu: float = 0.4
    hfu: float | None = None  # hardware FLOPs utilisation; when given, the time comes from it, not from mfu
    ep: int = 1  # expert parallelism (a mixture of experts)
    cp: int = 1  # context parallelism: each rank holds seq_len / cp of the tokens
    micro_batch: int = 1
    recompute: str = "none"
    sequence_parallel: bool = False
    gpu_mtbf_hours: float = reliability.DEFAULT_GPU_MTBF_HOURS
    mtbf_source: str = reliability.FAILURE_PRESETS[reliability.DEFAULT_FAILURE_PRESET].source
    ckpt_gbps: float = reliability.DEFAULT_CKPT_GBPS
    shape: TransformerShape | None = None
    measured_activations: float | None = None  # bytes, from a meta-device forward
    counted_flops_per_sample: float | None = None  # forward+backward FLOPs, counted on the meta device
    # a shape given without --seq-len: its seq_len is a stand-in (rotary/ALiBi positions hold no parameters, so
    # the count is exact) and what grows with the sequence (FLOPs, time, activations) is reported as missing
    seq_len_known: bool = True
    seq_len_source: str = ""  # where the shape's sequence length came from, for the report
    warnings: tuple[str, ...] = ()  # the caller's, carried into the report (a sequence length taken by default)
    # what the strategy declares (hpctrain.estimate.strategy_memory): accumulation, pipeline depth, the kernels
    grad_accum: int = 1
    microbatches: int | None = None  # pipeline micro-batches per step; None: pp (the fewest that fill 1F1B)
    pp_schedule: str = "1f1b"
    attention: str = "flash"
    loss_parallel: bool = False
    vocab_parallel: bool = True
    deepspeed_stage: int = 2
    dp_replicate: int = 1  # hsdp: replicas (the shards are dp / dp_replicate)
    cpu_offload: bool = False
    reduce_every_microstep: bool = True

    def __post_init__(self) -> None:
        g = bounds.MAX_GPUS
        _positive(("--params", self.params, bounds.MAX_PARAMS), ("--gpus", self.gpus, g), ("--tp", self.tp, g),
                  ("--pp", self.pp, g), ("--micro-batch", self.micro_batch, bounds.MAX_ELEMENTS),
                  ("--mtbf-hours", self.gpu_mtbf_hours, bounds.MAX_HOURS),
                  ("--ckpt-bandwidth", self.ckpt_gbps, bounds.MAX_GBPS), ("--ep", self.ep, g), ("--cp", self.cp, g))
        if self.tokens is not None:
            _positive(("--tokens", self.tokens, bounds.MAX_TOKENS))
        if not 0 < self.mfu <= 1:
            raise UserError(f"--mfu {self.mfu} must be a fraction in (0, 1], e.g. 0.4 for 40%")
        if self.hfu is not None and not 0 < self.hfu <= 1:
            raise UserError(f"--hfu {self.hfu} must be a fraction in (0, 1] (--achieved-tflops at most the "
                            f"dense peak, {self.gpu.peak_flops(self.precision) / 1e12:g} TFLOP/s)")
        if self.precision not in PRECISIONS:
            raise UserError(f"--precision {self.precision!r} is not one of {', '.join(PRECISIONS)}")
        self.gpu.peak_flops(self.precision)  # fails on a precision the chip cannot run (fp8 on A100)
        if self.strategy is not None and self.strategy not in DECLARED_ONLY:
            gpu_memory.check_strategy(self.strategy)
        _positive(("--grad-accum", self.grad_accum, bounds.MAX_ELEMENTS), ("--dp-replicate", self.dp_replicate, g))
        if self.microbatches is not None:
            _positive(("--microbatches", self.microbatches, bounds.MAX_ELEMENTS))
        if self.gpus % (self.tp * self.pp * self.cp):
            raise UserError(f"--tp {self.tp} x --pp {self.pp} x --cp {self.cp} = {self.tp * self.pp * self.cp} does "
                            f"not divide --gpus {self.gpus}; data parallelism needs gpus = dp x tp x pp x cp")
        self._check_shape()
        self._check_batch()

    def _check_batch(self) -> None:
        """The job's global batch (micro-batch x pipeline micro-batches x accumulation x dp) within 2^40
        tokens (samples without a shape): what the activations and FLOPs are multiplied by."""
        pipeline = (self.microbatches or self.pp) if self.pp > 1 else 1
        samples = self.micro_batch * pipeline * self.grad_accum * self.dp
        tokens = self.shape.seq_len if self.shape is not None and self.seq_len_known else 1
        bounds.check_batch(samples, tokens, "--micro-batch x --grad-accum x the data-parallel degree"
                           + (" x --microbatches" if self.pp > 1 else ""))

    def _check_shape(self) -> None:
        if self.ep > 1 and (self.shape is None or self.shape.experts == 1):
            raise UserError(f"--ep {self.ep} needs a mixture of experts: give --experts (and a shape) or --hf-config")
        if self.dp % self.ep:
            raise UserError(f"--ep {self.ep} must divide the data-parallel degree {self.dp} "
                            "(expert parallelism takes its ranks from data parallelism)")
        if self.shape is None:
            return
        bounds.check_shape(self.shape)  # the CLI checked it; a caller of the library may not have
        if self.shape.heads % self.tp:
            raise UserError(f"--tp {self.tp} must divide --heads {self.shape.heads} (heads are split across TP ranks)")
        if self.shape.experts % self.ep:
            raise UserError(f"--ep {self.ep} must divide --experts {self.shape.experts} (whole experts per rank)")
        stage_layers(self.shape.layers, self.pp)  # at least one layer per stage; uneven stages are fine

    @property
    def topology(self) -> Topology:
        """The layout estimated (expert parallelism takes its ranks from data parallelism)."""
        dp = self.gpus // (self.tp * self.pp * self.cp)
        if dp % self.dp_replicate:
            raise UserError(f"--dp-replicate {self.dp_replicate} must divide the data-parallel degree {dp}")
        return Topology(pp=self.pp, dp_replicate=self.dp_replicate, dp_shard=dp // self.dp_replicate, tp=self.tp,
                        ep=self.ep, cp=self.cp)

    @property
    def dp(self) -> int:
        return self.topology.dp

    @property
    def active_params(self) -> float:
        """Parameters a token uses (a mixture's active share of ``params``)."""
        return self.params if self.shape is None else self.params * self.shape.active_params / self.shape.params

    @property
    def multiplied_params(self) -> float:
        """Of those, the ones a token multiplies by (MFU's): less the input lookup tables."""
        if self.shape is None:
            return self.params
        return self.params * (self.shape.active_params - self.shape.lookup_params) / self.shape.params


def _legacy(recompute: str) -> str:
    """The table's (Korthikanti's) recompute mode: torchtitan's op-level selective as selective."""
    return "selective" if recompute == "selective_op" else recompute


def _positive(*checks: tuple[str, float, float]) -> None:
    """Each (flag, value, most): positive, finite and at most ``most`` (:mod:`hpctrain.estimate.bounds`)."""
    for flag, value, most in checks:
        bounds.check_number(flag, value, most)


def estimate(inp: Inputs) -> dict[str, Any]:
    layout = gpu_memory.layout_for(inp.precision, inp.amp_layout)
    needs = _compute_needs(inp)
    return {
        "model": {"params": inp.params, "active_params": inp.active_params, "source": inp.source,
                  "shape": _shape_dict(inp), "seq_len": _seq_len(inp), "seq_len_source": inp.seq_len_source or None},
        "parallel": {"gpus": inp.gpus, "dp": inp.dp, "tp": inp.tp, "pp": inp.pp, "ep": inp.ep, "cp": inp.cp,
                     "sequence_parallel": inp.sequence_parallel},
        "compute": None if needs else _compute(inp),
        "compute_needs": needs,
        "memory": _memory(inp, layout),
        **_checkpointing(inp, layout),
        "inputs": _inputs(inp),
        "assumptions": _assumptions(inp, layout),
        "warnings": list(inp.warnings),
    }


def _seq_len(inp: Inputs) -> int | None:
    return inp.shape.seq_len if inp.shape is not None and inp.seq_len_known else None


def _shape_dict(inp: Inputs) -> dict[str, Any] | None:
    if inp.shape is None:
        return None
    return {**vars(inp.shape), "seq_len": _seq_len(inp)}  # never the stand-in of a shape without --seq-len


def _compute_needs(inp: Inputs) -> list[str]:
    """The flags FLOPs and time still need: tokens always; a shape's sequence length (attention's
    FLOPs grow with it), unless the counted FLOPs of a --model stand in for the shape."""
    needs = ["--tokens"] if inp.tokens is None else []
    return needs + (["--seq-len"] if inp.shape is not None and not inp.seq_len_known else [])


def _inputs(inp: Inputs) -> dict[str, Any]:
    """Every input the estimate used, resolved (defaults filled in), for ``--json``."""
    gpu = inp.gpu
    return {"params": inp.params, "params_source": inp.source, "tokens": inp.tokens, "seq_len": _seq_len(inp),
            "seq_len_source": inp.seq_len_source or None, "gpus": inp.gpus,
            "gpu": {"name": gpu.name, "memory_gb": gpu.memory_gb, "peak_tflops": gpu.peak_flops(inp.precision) / 1e12,
                    "precision": inp.precision, "source": gpu.source},
            "strategy": inp.strategy, "tp": inp.tp, "pp": inp.pp, "ep": inp.ep, "cp": inp.cp, "dp": inp.dp,
            "sequence_parallel": inp.sequence_parallel, "precision": inp.precision, "amp_layout": inp.amp_layout,
            "mfu": None if inp.hfu is not None else inp.mfu, "hfu": inp.hfu, "micro_batch": inp.micro_batch,
            "activation_checkpointing": inp.recompute, "gpu_mtbf_hours": inp.gpu_mtbf_hours,
            "mtbf_source": inp.mtbf_source, "ckpt_bandwidth_gbps": inp.ckpt_gbps, "grad_accum": inp.grad_accum,
            "microbatches": inp.microbatches, "pp_schedule": inp.pp_schedule, "attention": inp.attention,
            "loss_parallel": inp.loss_parallel, "vocab_parallel": inp.vocab_parallel,
            "deepspeed_stage": inp.deepspeed_stage, "dp_replicate": inp.dp_replicate, "cpu_offload": inp.cpu_offload,
            "reduce_every_microstep": inp.reduce_every_microstep}


def _assumptions(inp: Inputs, layout: gpu_memory.StateLayout) -> dict[str, str]:
    """What the numbers take for granted, in words (``--json`` and docs/estimate.md say the same)."""
    _, _, _, flops_from = _flops(inp, inp.tokens or 1.0)
    out = {
        "units": "GB = 1e9 bytes; TFLOP/s dense (no 2:4 sparsity)",
        "optimizer": f"Adam; model states {layout.name}",
        "flops": f"{flops_from}: 6 FLOPs per parameter a token multiplies by, forward+backward"
                 + ("; attention 12·L·heads·head_dim·s per token, causal masking not halved"
                    if inp.shape is not None else ""),
        "utilisation": f"HFU {inp.hfu:g} given" if inp.hfu is not None else f"MFU {inp.mfu:g} (0.4 unless given)",
        "memory": "the datasheet capacity in GB; CUDA context, allocator fragmentation and DDP/ZeRO communication "
                  "buckets not modelled; ZeRO-3/FSDP hold 2 unsharded layers in flight (with a shape)",
        "activations": _stages(inp)[1],
        "checkpoint": f"{layout.checkpoint:g} B/param: weights and optimizer state, no gradients",
        "failures": f"per-GPU MTBF {inp.gpu_mtbf_hours:,.0f} h ({inp.mtbf_source}); the cluster's is that / GPUs",
    }
    if inp.precision == "fp8":
        out["fp8"] = "activations and gathered weights counted as 16-bit (conservative)"
    if inp.shape is not None:
        out["seq_len"] = (f"{inp.shape.seq_len:,} from {inp.seq_len_source or 'the shape'}" if inp.seq_len_known
                          else "not given: the parameter count needs none; FLOPs, time and activations do (--seq-len)")
    return out


def _flops(inp: Inputs, tokens: float) -> tuple[float, float, float | None, str]:
    """(6ND from the active parameters, model FLOPs, counted FLOPs or None, where the model FLOPs came from)."""
    six_nd = flops.training_flops(inp.active_params, tokens)
    if inp.counted_flops_per_sample is not None:
        counted = inp.counted_flops_per_sample * tokens
        return six_nd, counted, counted, "counted FLOPs"
    if inp.shape is not None:
        model = flops.training_flops(inp.multiplied_params, tokens) + flops.attention_flops(inp.shape, tokens)
        return six_nd, model, None, "6ND + attention"
    return six_nd, six_nd, None, "6ND"


def _compute(inp: Inputs) -> dict[str, Any] | None:
    if inp.tokens is None:
        return None
    six_nd, model, counted, source = _flops(inp, inp.tokens)
    if counted is not None:  # a full recompute runs the forward again: about a third of forward+backward
        hardware = model * (4 / 3 if inp.recompute == "full" else 1)
    else:
        hardware = model + flops.recompute_flops(inp.shape, inp.active_params, inp.tokens, _legacy(inp.recompute))
    peak = inp.gpu.peak_flops(inp.precision)
    if inp.hfu is not None:
        hfu, mfu, util_from = inp.hfu, inp.hfu * model / hardware, "--hfu"
    else:
        mfu, hfu, util_from = inp.mfu, inp.mfu * hardware / model, "--mfu"
    if hfu > 1:
        raise UserError(f"--mfu {mfu} with {inp.recompute} recomputation means {hfu:.0%} hardware FLOPs "
                        "utilisation; lower --mfu")
    seconds = flops.wall_seconds(model, inp.gpus, peak, mfu)
    return {"tokens": inp.tokens, "flops": six_nd, "pf_days": flops.pf_days(six_nd),
            "flops_with_attention": None if inp.shape is None else model, "flops_counted": counted,
            "model_flops": model, "hardware_flops": hardware, "time_from": source, "utilisation_from": util_from,
            "recompute": inp.recompute, "gpu": inp.gpu.name, "precision": inp.precision,
            "peak_tflops_per_gpu": peak / 1e12, "mfu": mfu, "hfu": hfu,
            "model_tflops_per_gpu": mfu * peak / 1e12, "hardware_tflops_per_gpu": hfu * peak / 1e12,
            "tokens_per_second": inp.tokens / seconds, "tokens_per_second_per_gpu": inp.tokens / seconds / inp.gpus,
            "wall_seconds": seconds, "wall_days": seconds / 86_400, "gpu_hours": seconds * inp.gpus / 3600}


@dataclass(frozen=True)
class _Stage:
    """What one pipeline stage's GPU holds before tp splits it: its parameters (experts among
    them) and its activations."""

    index: int
    layers: int | None
    params: float
    expert_params: float
    activations: float | None


def _stages(inp: Inputs) -> tuple[list[_Stage], str]:
    """Every pipeline stage with a shape (uneven ones allowed); one even share of ``params`` without."""
    e = gpu_memory.compute_bytes(inp.precision)
    if inp.shape is None:
        measured, method = ((inp.measured_activations, "tensors saved for backward in a meta-device forward")
                            if inp.measured_activations is not None
                            else (None, "unknown: give a transformer shape (--layers ...) or --model"))
        return [_Stage(0, None, inp.params / inp.pp, 0.0, measured)], method
    shape, scale = inp.shape, inp.params / inp.shape.params  # scale: an explicit --params wins over the shape's
    acts: list[float | None] = [None] * inp.pp  # without --seq-len: the stages' parameters alone
    method = "unknown: give --seq-len (activations grow with the sequence)"
    if inp.seq_len_known:
        acts = list(activations.stage_bytes(shape, inp.micro_batch, tp=inp.tp, pp=inp.pp,
                                            sequence_parallel=inp.sequence_parallel, recompute=_legacy(inp.recompute),
                                            element_bytes=e, cp=inp.cp))
        method = "Korthikanti et al. 2022 (transformer shape)"
    routed = [sum(shape.routed_params(b) for b in blocks) for blocks in stage_blocks(shape.layers, inp.pp)]
    stages = [_Stage(i, n, held * scale, experts * scale, a) for i, (n, held, experts, a) in
              enumerate(zip(stage_layers(shape.layers, inp.pp), stage_params(shape, inp.pp), routed, acts,
                            strict=True))]
    return stages, method


def _largest(inp: Inputs, strategy: str, layout: gpu_memory.StateLayout,
             stages: list[_Stage]) -> tuple[gpu_memory.MemoryBreakdown, _Stage]:
    """The stage whose GPU needs the most memory under ``strategy``: what each GPU must hold."""
    e = gpu_memory.compute_bytes(inp.precision)
    rows = [(gpu_memory.per_rank(st.params, strategy, dp=inp.dp, tp=inp.tp, layout=layout, shape=inp.shape,
                             element_bytes=e, activation_bytes=st.activations, expert_params=st.expert_params,
                             ep=inp.ep), st) for st in stages]
    return max(rows, key=lambda row: row[0].total)


def declared_inputs(inp: Inputs) -> strategy_memory.MemoryInputs | None:
    """What the selected strategy (fsdp when none is) declares for this estimate: it needs a shape
    and its sequence length. The table's zero2 / zero3 are DeepSpeed's stages."""
    if inp.shape is None or not inp.seq_len_known:
        return None
    strategy, stage = _DECLARED.get(inp.strategy or "fsdp", (inp.strategy or "fsdp", inp.deepspeed_stage))
    return strategy_memory.MemoryInputs(
        shape=inp.shape, topology=inp.topology, strategy=strategy, deepspeed_stage=stage, precision=inp.precision,
        amp_layout=inp.amp_layout, micro_batch=inp.micro_batch, grad_accum=inp.grad_accum,
        reduce_every_microstep=inp.reduce_every_microstep, cpu_offload=inp.cpu_offload, recompute=inp.recompute,
        sequence_parallel=inp.sequence_parallel, microbatches=inp.microbatches or inp.pp, pp_schedule=inp.pp_schedule,
        attention=inp.attention, params=inp.params, vocab_parallel=inp.vocab_parallel,
        loss_parallel=inp.loss_parallel)


def _declared(inp: Inputs) -> dict[str, Any] | None:
    declared = declared_inputs(inp)
    if declared is None:
        return None
    stages = strategy_memory.stage_memory(declared)
    largest = max(stages, key=lambda m: m.total)
    return {"strategy": declared.strategy, "deepspeed_stage": declared.deepspeed_stage if
            declared.strategy == "deepspeed" else None, "attention": declared.attention,
            "grad_accum": declared.grad_accum, "microbatches": declared.microbatches if inp.pp > 1 else None,
            "pp_schedule": declared.pp_schedule if inp.pp > 1 else None, "loss_parallel": declared.loss_parallel,
            **largest.as_dict(), "fits": largest.total <= inp.gpu.memory_bytes,
            "stages": [m.total for m in stages]}


def _declared_rows(inp: Inputs) -> dict[str, tuple[gpu_memory.MemoryBreakdown, int]] | None:
    """The table's rows from the strategies' declaration (what the declared line and the planner
    use), so the two cannot disagree: each strategy's busiest stage, its parts in the table's columns
    (a pipeline stage's whole gradients among the gradients, its gathered parameters among the
    gathered ones; the block being recomputed and the loss's buffers among the activations). None
    without a shape and its sequence length: the ZeRO accounting of a bare parameter count."""
    base = declared_inputs(inp)
    if base is None:
        return None
    rows = {}
    for name in gpu_memory.STRATEGIES:
        strategy, stage = _DECLARED.get(name, (name, inp.deepspeed_stage))
        m = strategy_memory.strategy_memory(replace(base, strategy=strategy, deepspeed_stage=stage))
        rows[name] = (gpu_memory.MemoryBreakdown(
            name, m.weights, m.gradients + m.pipeline_grads, m.optimizer,
            m.gathered + m.pipeline_held - m.pipeline_grads, m.activations + m.recomputed + m.transient), m.stage)
    return rows


def _memory(inp: Inputs, layout: gpu_memory.StateLayout) -> dict[str, Any]:
    stages, method = _stages(inp)
    declared = _declared_rows(inp)
    if declared is not None:
        largest = {s: (row, stages[i]) for s, (row, i) in declared.items()}
        method = (f"the strategies' declaration: {method}, {inp.attention} attention; activations include the "
                  "block being recomputed and the loss's buffers")
    else:
        largest = {s: _largest(inp, s, layout, stages) for s in gpu_memory.STRATEGIES}
    rows = {s: row for s, (row, _) in largest.items()}
    capacity = inp.gpu.memory_bytes
    pipeline = None
    if inp.shape is not None and inp.pp > 1:
        st = largest[inp.strategy if inp.strategy in largest else gpu_memory.smallest_fit(rows, capacity) or "ddp"][1]
        pipeline = {"stage_layers": [s.layers for s in stages], "largest_stage": st.index,
                    "largest_stage_layers": st.layers}
    return {"layout": layout.name, "bytes_per_param": layout.weights + layout.grads + layout.optimizer,
            "gpu_memory_bytes": capacity, "micro_batch": inp.micro_batch, "activation_checkpointing": inp.recompute,
            "activations_method": method, "pipeline": pipeline,
            "strategies": {s: {**b.as_dict(), "fits": b.total <= capacity, "stage": largest[s][1].index}
                           for s, b in rows.items()},
            "selected": inp.strategy, "smallest_fit": gpu_memory.smallest_fit(rows, capacity),
            "declared": _declared(inp)}


def _checkpointing(inp: Inputs, layout: gpu_memory.StateLayout) -> dict[str, Any]:
    size = inp.params * layout.checkpoint
    save = reliability.write_seconds(size, inp.ckpt_gbps * 1e9)
    mtbf_h = reliability.cluster_mtbf_hours(inp.gpu_mtbf_hours, inp.gpus)
    interval = reliability.young_daly_seconds(save, mtbf_h * 3600)
    return {
        "checkpoint": {"bytes": size, "bytes_per_param": layout.checkpoint,
                       "bandwidth_bytes_per_s": inp.ckpt_gbps * 1e9, "write_seconds": save},
        "reliability": {"gpu_mtbf_hours": inp.gpu_mtbf_hours, "mtbf_source": inp.mtbf_source, "gpus": inp.gpus,
                        "cluster_mtbf_hours": mtbf_h,
                        "young_daly_seconds": interval,
                        "overhead_fraction": reliability.overhead_fraction(save, interval, mtbf_h * 3600)},
    }
