"""FLOPs per training step and MFU (model FLOPs utilisation).

Convention (see docs/telemetry.md):
- the forward pass is counted by :func:`hpctrain.telemetry.measure.count_flops` (the
  estimator's and the planner's counter, ``torch.utils.flop_counter``): matmuls,
  convolutions and attention, 2 FLOPs per multiply-add; elementwise ops, norms, softmax
  and the optimizer are not counted;
- it runs on meta copies of the weights and inputs: no real compute, no change to the
  model's buffers or the RNG, and attention decomposes into the batched matmuls of the
  math path, counted at full T x T even when causal (as PyTorch's counter and the
  6N + 12LHQT formula of PaLM's MFU do);
- a training step is 3 x forward (backward = 2 x forward, the model-FLOPs convention,
  even where autograd skips the first layer's input gradient) x gradient-accumulation steps;
- MFU = one rank's step FLOPs / step seconds / ONE device's dense peak: never global
  FLOPs over a per-device peak.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import json
import logging
import os
import platform
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from hpctrain.core.cache import cache_root
from hpctrain.core.modules import is_sharded
from hpctrain.telemetry import measure
from hpctrain.telemetry.accelerators import peak_tflops

log = logging.getLogger("hpctrain")

BACKWARD_FACTOR = 2  # backward = 2 x forward: gradients w.r.t. inputs and w.r.t. weights


@dataclass(frozen=True)
class Peak:
    """A device's peak FLOP/s and where the figure comes from (shown next to the MFU)."""

    flops: float
    source: str


def forward_flops(model: nn.Module, *inputs: Any) -> int:
    """FLOPs of one forward pass of ``model`` on ``inputs`` (one micro-batch, one rank).

    Counted on meta tensors; a model that cannot run on meta (data-dependent Python
    control flow, ops without a meta kernel) is counted on a throw-away copy instead."""
    try:
        return _count_on_meta(model, inputs)
    except Exception as err:  # noqa: BLE001 - any failure on meta: count for real on a copy
        if is_sharded(model):  # a copy's forward would run collectives on one rank's whim: never
            raise
        log.debug("FLOP count on meta failed (%s); counting on a copy", err)
        return _count_on_copy(model, inputs)


def train_step_flops(model: nn.Module, *inputs: Any, grad_accum: int = 1) -> int:
    """FLOPs of one optimizer step on one rank: 3 x forward x micro-batches."""
    return (1 + BACKWARD_FACTOR) * forward_flops(model, *inputs) * grad_accum


def _count_on_meta(model: nn.Module, inputs: tuple[Any, ...]) -> int:
    state = {name: torch.empty_like(t, device="meta")
             for name, t in itertools.chain(model.named_parameters(), model.named_buffers())}
    meta_inputs = tree_map(lambda x: x.to("meta") if isinstance(x, torch.Tensor) else x, inputs)
    with _hooks_off(model), torch.no_grad():
        return measure.count_flops(lambda: torch.func.functional_call(model, state, meta_inputs, strict=False)).total


_FORWARD_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs",
                  "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called")


@contextlib.contextmanager
def _hooks_off(model: nn.Module) -> Iterator[None]:
    """The user's forward hooks stay silent while the count runs the model: a hook that
    counts calls or records activations must see training's forward passes only."""
    saved = [(m, name, getattr(m, name)) for m in model.modules() for name in _FORWARD_HOOKS if hasattr(m, name)]
    for module, name, hooks in saved:
        setattr(module, name, type(hooks)())
    try:
        yield
    finally:
        for module, name, hooks in saved:
            setattr(module, name, hooks)


def _count_on_copy(model: nn.Module, inputs: tuple[Any, ...]) -> int:
    clone = copy.deepcopy(model)  # batch-norm statistics and the like stay untouched
    with _hooks_off(clone), torch.random.fork_rng(devices=[]), torch.no_grad():
        return measure.count_flops(lambda: clone(*inputs)).total


def mfu(step_flops: float, step_seconds: float, peak: Peak) -> float:
    """Model FLOPs utilisation of one rank: achieved FLOP/s over its own device's peak."""
    if step_seconds <= 0 or peak.flops <= 0:
        return 0.0
    value = step_flops / step_seconds / peak.flops
    if value > 1.0:
        log.warning("MFU %.2f > 1: the peak (%s) is too low for this device; set telemetry.peak_tflops", value,
                    peak.source)
    return value


# ---------------------------------------------------------------- peaks


def peak_flops(device: torch.device, precision: str, override_tflops: float | None = None,
               cache_dir: Path | None = None) -> Peak | None:
    """The denominator of MFU: ``telemetry.peak_tflops`` if given, else the accelerator
    table (hpctrain.telemetry.accelerators) for GPUs, else a measured matmul peak on CPU.
    None (MFU not reported, with a warning) for a GPU the table does not know."""
    if override_tflops:
        return Peak(override_tflops * 1e12, "telemetry.peak_tflops")
    if device.type == "cpu":
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
        return Peak(cpu_matmul_peak(dtype, cache_dir), f"{cpu_name()} {dtype} matmul probe")
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    key = accelerator_key(name)
    if key is None:
        log.warning("no peak FLOP/s known for %r: MFU is not reported; hint: set telemetry.peak_tflops", name)
        return None
    table_precision = _table_precision(precision)
    return Peak(peak_tflops(key, table_precision) * 1e12, f"{name} dense {table_precision} (datasheet)")


# (substring of the reported device name, the table's key), the first match wins: more specific first
_DEVICE_KEYS = (("mi300x", "mi300x"), ("h200", "h200"), ("h800", "h800"), ("h100 nvl", "h100-nvl"),
                ("h100 pcie", "h100-pcie"), ("h100", "h100-sxm"), ("a100-sxm4-40gb", "a100-40gb"),
                ("a100-pcie-40gb", "a100-40gb"), ("a100", "a100"), ("b200", "b200"), ("l40s", "l40s"),
                ("v100", "v100"))


def accelerator_key(device_name: str) -> str | None:
    """The peak table's key for a device name as CUDA/ROCm reports it, e.g. 'NVIDIA H100 80GB HBM3'."""
    name = device_name.lower()
    return next((key for part, key in _DEVICE_KEYS if part in name), None)


def _table_precision(precision: str) -> str:
    if precision in ("bf16", "fp16", "fp8"):
        return precision
    # fp32 matmuls run on TF32 tensor cores unless torch is told to keep full precision
    return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"


# ---------------------------------------------------------------- the CPU probe


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_matmul_peak(dtype: torch.dtype = torch.float32, cache_dir: Path | None = None) -> float:
    """This machine's matmul FLOP/s at the current thread count: measured once (well
    under a second), then read from ``~/.cache/hpctrain/cpu_peak.json``."""
    path = (cache_dir or _default_cache_dir()) / "cpu_peak.json"
    key = f"{cpu_name()}|threads={torch.get_num_threads()}|{dtype}|torch={torch.__version__}"
    cached = _read_cache(path)
    if key in cached:
        return float(cached[key])
    peak = _probe(dtype)
    cached[key] = peak
    _write_cache(path, cached)
    return peak


def remeasure_cpu_peak(peak: Peak, achieved: float, dtype: torch.dtype = torch.float32,
                       cache_dir: Path | None = None) -> Peak:
    """A run beat its cached CPU peak: the probe was disturbed by other work when it ran
    (a busy shared node). Probe again and keep the best of the cache, the new probe and
    what the run achieved, so MFU stays <= 1 and the cache only ever improves."""
    path = (cache_dir or _default_cache_dir()) / "cpu_peak.json"
    key = f"{cpu_name()}|threads={torch.get_num_threads()}|{dtype}|torch={torch.__version__}"
    cached = _read_cache(path)
    best = max(cached.get(key, 0.0), _probe(dtype), achieved)
    cached[key] = best
    _write_cache(path, cached)
    return Peak(best, peak.source + " (re-measured)")


def _probe(dtype: torch.dtype, n: int = 1024, seconds: float = 0.3) -> float:
    """Best of repeated n x n matmuls: the best run is the least disturbed by other work."""
    # A generator of its own: the probe runs inside training (first step, or again when a
    # run beats it) and must not move the global RNG that dropout and data order draw from.
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=gen).to(dtype), torch.randn(n, n, generator=gen).to(dtype)
    out = torch.empty(n, n, dtype=dtype)
    torch.mm(a, b, out=out)  # warm-up: thread pool and kernel selection
    best, deadline, reps = float("inf"), time.perf_counter() + seconds, 0
    while reps < 3 or time.perf_counter() < deadline:
        start = time.perf_counter()
        torch.mm(a, b, out=out)
        best, reps = min(best, time.perf_counter() - start), reps + 1
    return 2 * n**3 / best


def _default_cache_dir() -> Path:
    return cache_root()


def _read_cache(path: Path) -> dict[str, float]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_cache(path: Path, data: dict[str, float]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, path)  # ranks probing at once each write a whole file
    except OSError as err:  # a read-only home only costs a probe per run
        log.debug("cannot cache the CPU peak in %s: %s", path, err)
