"""One sizing estimate: validated inputs in, a JSON-ready dict out (the CLI only renders it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hpctrain.errors import UserError
from hpctrain.estimate import activations, flops, memory, reliability
from hpctrain.estimate.hardware import PRECISIONS, Accelerator
from hpctrain.estimate.model import TransformerShape


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
    micro_batch: int = 1
    recompute: str = "none"
    sequence_parallel: bool = False
    gpu_mtbf_hours: float = reliability.DEFAULT_GPU_MTBF_HOURS
    ckpt_gbps: float = reliability.DEFAULT_CKPT_GBPS
    shape: TransformerShape | None = None
    measured_activations: float | None = None  # bytes, from a meta-device forward
    counted_flops_per_sample: float | None = None  # forward+backward FLOPs, counted on the meta device

    def __post_init__(self) -> None:
        _positive(("--params", self.params), ("--gpus", self.gpus), ("--tp", self.tp), ("--pp", self.pp),
                  ("--micro-batch", self.micro_batch), ("--mtbf-hours", self.gpu_mtbf_hours),
                  ("--ckpt-bandwidth", self.ckpt_gbps))
        if self.tokens is not None:
            _positive(("--tokens", self.tokens))
        if not 0 < self.mfu <= 1:
            raise UserError(f"--mfu {self.mfu} must be a fraction in (0, 1], e.g. 0.4 for 40%")
        if self.precision not in PRECISIONS:
            raise UserError(f"--precision {self.precision!r} is not one of {', '.join(PRECISIONS)}")
        self.gpu.peak_flops(self.precision)  # fails on a precision the chip cannot run (fp8 on A100)
        if self.strategy is not None:
            memory.check_strategy(self.strategy)
        if self.gpus % (self.tp * self.pp):
            raise UserError(f"--tp {self.tp} x --pp {self.pp} = {self.tp * self.pp} does not divide --gpus "
                            f"{self.gpus}; data parallelism needs gpus = dp x tp x pp")
        self._check_shape()

    def _check_shape(self) -> None:
        if self.shape is None:
            return
        if self.shape.heads % self.tp:
            raise UserError(f"--tp {self.tp} must divide --heads {self.shape.heads} (heads are split across TP ranks)")
        if self.shape.layers % self.pp:
            raise UserError(f"--pp {self.pp} must divide --layers {self.shape.layers} (layers per pipeline stage)")

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)


def _positive(*pairs: tuple[str, float]) -> None:
    for flag, value in pairs:
        if not value > 0:
            raise UserError(f"{flag} must be positive, got {value}")


def estimate(inp: Inputs) -> dict[str, Any]:
    layout = memory.layout_for(inp.precision, inp.amp_layout)
    return {
        "model": {"params": inp.params, "source": inp.source,
                  "shape": None if inp.shape is None else vars(inp.shape)},
        "parallel": {"gpus": inp.gpus, "dp": inp.dp, "tp": inp.tp, "pp": inp.pp,
                     "sequence_parallel": inp.sequence_parallel},
        "compute": _compute(inp),
        "memory": _memory(inp, layout),
        **_checkpointing(inp, layout),
    }


def _compute(inp: Inputs) -> dict[str, Any] | None:
    if inp.tokens is None:
        return None
    total = flops.training_flops(inp.params, inp.tokens)
    counted = None if inp.counted_flops_per_sample is None else inp.counted_flops_per_sample * inp.tokens
    peak = inp.gpu.peak_flops(inp.precision)
    seconds = flops.wall_seconds(total if counted is None else counted, inp.gpus, peak, inp.mfu)
    return {"tokens": inp.tokens, "flops": total, "pf_days": flops.pf_days(total),
            "flops_with_attention": None if inp.shape is None else total + flops.attention_flops(inp.shape, inp.tokens),
            "flops_counted": counted, "time_from": "6ND" if counted is None else "counted FLOPs",
            "gpu": inp.gpu.name, "precision": inp.precision, "peak_tflops_per_gpu": peak / 1e12, "mfu": inp.mfu,
            "wall_seconds": seconds, "wall_days": seconds / 86_400, "gpu_hours": seconds * inp.gpus / 3600}


def _activation_bytes(inp: Inputs) -> tuple[float | None, str]:
    e = memory.compute_bytes(inp.precision)
    if inp.shape is not None:
        value = activations.transformer_bytes(inp.shape, inp.micro_batch, tp=inp.tp, pp=inp.pp,
                                              sequence_parallel=inp.sequence_parallel, recompute=inp.recompute,
                                              element_bytes=e)
        return value, "Korthikanti et al. 2022 (transformer shape)"
    if inp.measured_activations is not None:
        return inp.measured_activations, "tensors saved for backward in a meta-device forward"
    return None, "unknown: give a transformer shape (--layers ...) or --model"


def _memory(inp: Inputs, layout: memory.StateLayout) -> dict[str, Any]:
    acts, method = _activation_bytes(inp)
    e = memory.compute_bytes(inp.precision)
    rows = {s: memory.per_rank(inp.params, s, dp=inp.dp, tp=inp.tp, pp=inp.pp, layout=layout, shape=inp.shape,
                               element_bytes=e, activation_bytes=acts) for s in memory.STRATEGIES}
    capacity = inp.gpu.memory_bytes
    return {"layout": layout.name, "bytes_per_param": layout.weights + layout.grads + layout.optimizer,
            "gpu_memory_bytes": capacity, "micro_batch": inp.micro_batch, "activation_checkpointing": inp.recompute,
            "activations_method": method,
            "strategies": {s: {**b.as_dict(), "fits": b.total <= capacity} for s, b in rows.items()},
            "selected": inp.strategy, "smallest_fit": memory.smallest_fit(rows, capacity)}


def _checkpointing(inp: Inputs, layout: memory.StateLayout) -> dict[str, Any]:
    size = inp.params * layout.checkpoint
    save = reliability.write_seconds(size, inp.ckpt_gbps * 1e9)
    mtbf_h = reliability.cluster_mtbf_hours(inp.gpu_mtbf_hours, inp.gpus)
    interval = reliability.young_daly_seconds(save, mtbf_h * 3600)
    return {
        "checkpoint": {"bytes": size, "bytes_per_param": layout.checkpoint,
                       "bandwidth_bytes_per_s": inp.ckpt_gbps * 1e9, "write_seconds": save},
        "reliability": {"gpu_mtbf_hours": inp.gpu_mtbf_hours, "gpus": inp.gpus, "cluster_mtbf_hours": mtbf_h,
                        "young_daly_seconds": interval,
                        "overhead_fraction": reliability.overhead_fraction(save, interval, mtbf_h * 3600)},
    }
