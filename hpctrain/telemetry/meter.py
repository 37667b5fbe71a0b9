"""Where a step's time goes, per logged interval and over the run: the step-time breakdown,
throughput, MFU, peak memory and (NVML) GPU utilisation, power and temperature.

The loop marks the end of each phase: ``meter.data()`` once the batch is on the device,
``meter.compute()`` after forward and backward (or ``forward()`` and ``backward()`` apart),
``meter.optimizer()``, ``checkpoint()``, ``evaluation()``, ``other()``; the trainer's hot path
calls :meth:`Meter.lap` with the phase's index. Each mark adds the time since the previous
one to its phase, so the phases of an interval add up to its wall time. A lap is
one ``perf_counter`` read and one addition; nothing on the hot path synchronises a device.
On a GPU the host therefore runs ahead of the device, and device time shows up in the
phase where the host next waits (the loss read of a log row, the allocator, the data
copy): the split between forward+backward and the optimizer step is a host-side split.
``telemetry.sync_timing=true`` synchronises the device at every lap instead (exact
device-side phases, at a cost in throughput).

Stragglers need each rank's own compute without the wait for other ranks inside the
gradient all-reduce, so the meter also keeps the forward time, by ``perf_counter`` on CPU
(and under sync_timing), by CUDA events read only at interval ends on GPUs.

Windows (log rows, straggler gathers) are differences of cumulative totals, so two
windows of different lengths cost nothing extra per step.
"""

from __future__ import annotations

import logging
import resource
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from hpctrain.core import protocol as heartbeat
from hpctrain.telemetry.flops import Peak, remeasure_cpu_peak, train_step_flops
from hpctrain.telemetry.gpu import GpuMonitor

log = logging.getLogger("hpctrain")

# Phases, as list indices: the hot path adds to a list slot, no dict lookups.
DATA, FORWARD, BACKWARD, OPTIM, CKPT, EVAL, OTHER = range(7)
_N_PHASES = 7
# The row's breakdown columns (seconds per optimizer step), as hpctrain report reads them.
_COLUMNS = {"time_data_s": (DATA,), "time_fwd_bwd_s": (FORWARD, BACKWARD), "time_optim_s": (OPTIM,),
            "time_ckpt_s": (CKPT,), "time_eval_s": (EVAL,), "time_other_s": (OTHER,)}


@dataclass
class _Mark:
    """The cumulative totals at a window's start."""

    time: float
    step: int
    seconds: list[float]
    forward: float
    # this rank's tokens counted step by step (Meter.add_tokens), when it counts them: a float, or the
    # running total's device tensor itself (a snapshot without a sync: add_tokens makes a new one)
    tokens: Any = 0.0


@dataclass
class Meter:
    """Create once before the loop (``step``: the optimizer steps already done, after a resume).

    ``global_batch``: samples per optimizer step over all ranks; ``grad_accum`` and
    ``world_size`` (the data-parallel replicas) turn a micro-batch's token count into tokens
    per step; ``peak``: the device's peak FLOP/s (None: no MFU); ``flops_divisor``: the share
    of the replica's FLOPs one rank runs (hpctrain.core.topology.Topology.flop_divisor: pp x tp, one
    stage, 1/tp of each block's matmuls)."""

    global_batch: int
    step: int
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    grad_accum: int = 1
    world_size: int = 1
    peak: Peak | None = None
    sync_timing: bool = False
    flops_divisor: int = 1
    step_flops: int | None = None       # one rank's FLOPs per optimizer step (counted on the first batch)
    tokens_per_step: int | None = None  # over all ranks, when the batch says how many tokens it holds
    positions_per_step: int | None = None  # token positions (real and padding) per step over all ranks
    # True: every micro-batch's real tokens are added (add_tokens): padded batches hold different counts
    tokens_each_step: bool = False

    def __post_init__(self) -> None:
        cuda = self.device.type == "cuda"
        self._sync = self.sync_timing and cuda
        self._events = _ForwardEvents() if cuda and not self._sync else None
        self._gpu = GpuMonitor.open(self.device)
        self._seconds = [0.0] * _N_PHASES
        self._forward_device = 0.0  # seconds of forward read from CUDA events so far
        self._mem_peak = 0.0
        self._tokens: Any = 0  # a device tensor once counting: added without a sync, read at marks
        self._warned = False
        self.counted = False
        self._beat = heartbeat.from_env()  # under hpctrain run: the launcher's watchdog reads it
        self.restart(self.step)

    def restart(self, step: int) -> None:
        """Start the clock (again) now, e.g. right before the loop, after the set-up."""
        self.step = step
        self._last = time.perf_counter()
        self._start = self._mark()
        self._log_mark = self._straggler_mark = self._start
        self._warm: _Mark | None = None  # the end of the first optimizer step (see summary)
        self._end: _Mark | None = None  # the end of the loop (finishing)
        if self._beat is not None:
            self._beat.at_step(step)

    # ---------------------------------------------------------------- the hot path

    def lap(self, phase: int) -> None:
        """The time since the previous lap was spent in ``phase``."""
        if self._sync:
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self._seconds[phase] += now - self._last
        self._last = now
        if self._events is not None:
            self._events.mark(phase)
        if self._beat is not None:
            self._beat.beat(phase)
        if phase == OPTIM and self._warm is None:  # once: the first optimizer step is over
            self._warm = self._snapshot(self._start.step + 1)

    # The phases by name, for a loop of your own: call each right after the phase it names.

    def data(self) -> None:
        """Getting the batch: the loader's wait and the copy to the device."""
        self.lap(DATA)

    def compute(self) -> None:
        """Forward and backward in one call (``strategy.micro_step``). Booked as forward, which the
        straggler check reads as a rank's own compute: here it includes the gradient all-reduce."""
        self.lap(FORWARD)

    def forward(self) -> None:
        self.lap(FORWARD)

    def backward(self) -> None:
        self.lap(BACKWARD)

    def optimizer(self) -> None:
        """The optimizer step (and zeroing the gradients)."""
        self.lap(OPTIM)

    def checkpoint(self) -> None:
        self.lap(CKPT)

    def evaluation(self) -> None:
        self.lap(EVAL)

    def other(self) -> None:
        self.lap(OTHER)

    def add_tokens(self, count: Any) -> None:
        """This rank's real tokens of a micro-batch (a tensor is added on its device, read only
        at interval ends: no sync on the hot path)."""
        self._tokens = self._tokens + count

    def finishing(self) -> None:
        """The loop is over: the heartbeat says so (the final validation and save may take
        long), later laps no longer count as the loop's progress, and the summary's window ends."""
        if self._end is not None:
            return
        now = time.perf_counter()  # the loop's last moments are "other" (no device sync: this may run on an error)
        self._seconds[OTHER] += now - self._last
        self._last = now
        heartbeat.finishing()
        self._beat = None
        self._end = self._snapshot(self.step)  # the summary's window ends here, before the final validation and save

    def first_batch(self, model: nn.Module, batch: Any, tokens: int | None = None, positions: int | None = None
                    ) -> None:
        """Once, on the first micro-batch: FLOPs per step (on meta: no compute) and the tokens
        per step, from ``tokens`` (this rank's tokens in the micro-batch; a token-level task
        knows them) or else the batch's ``num_tokens`` attribute, if it has one. ``positions``:
        the micro-batch's token positions, padding included; with :attr:`tokens_each_step`, MFU
        counts the FLOPs of the real tokens only (the step's FLOPs times their share)."""
        self.counted = True
        try:
            self.step_flops = train_step_flops(model, batch.inputs, grad_accum=self.grad_accum) // self.flops_divisor
        except Exception as err:  # noqa: BLE001 - an uncountable model only loses its MFU
            log.warning("cannot count the model's FLOPs (%s: %s): MFU is not reported", type(err).__name__, err)
        tokens = tokens if tokens is not None else getattr(batch, "num_tokens", None)
        if tokens is not None:
            self.tokens_per_step = int(tokens) * self.grad_accum * self.world_size
        if positions:
            self.positions_per_step = int(positions) * self.grad_accum * self.world_size
        self.lap(OTHER)

    # ---------------------------------------------------------------- windows

    def interval(self, step: int) -> dict[str, float]:
        """The metrics row's measurements since the previous call."""
        now = self._mark(step)
        row = self._window(self._log_mark, now)
        self._log_mark = now
        row |= self._memory()
        if self._gpu is not None:
            row |= self._gpu.sample()
        return row

    def straggler_times(self, step: int) -> tuple[float, float, float]:
        """(step, data wait, own compute) seconds per step since the previous call: what
        :class:`~hpctrain.telemetry.stragglers.StragglerDetector` gathers."""
        now = self._mark(step)
        prev, self._straggler_mark = self._straggler_mark, now
        steps = max(now.step - prev.step, 1)
        return ((now.time - prev.time) / steps, (now.seconds[DATA] - prev.seconds[DATA]) / steps,
                (now.forward - prev.forward) / steps)

    def summary(self, step: int) -> dict[str, Any]:
        """The training loop's means: this process's steps (after a resume, its own), from the end
        of its first optimizer step to the end of the loop (:meth:`finishing`), the rates over the
        training time (validation's time left out, as MFU does). The first step's one-off costs
        (torch.compile, cuDNN's autotuning, the first allocations, the FLOP count) would otherwise
        weigh on every rate of a short run: a compiled GPT's 60 steps on an H200 read MFU 0.02
        over the whole run, 0.31 in steady state. ``warmup_s``: the first step's seconds. A run
        of one step is measured whole."""
        end = replace(self._end, step=step) if self._end is not None else self._mark(step)  # no step after the loop
        warm = self._warm if self._warm is not None and end.step > self._warm.step else None
        out: dict[str, Any] = self._window(warm or self._start, end, training_only=True)
        out["warmup_s"] = warm.time - self._start.time if warm is not None else None
        out["mem_peak_gb"] = max(self._mem_peak, self._memory()["mem_peak_gb"])
        out["step_flops"] = self.step_flops
        out["peak_tflops"] = self.peak.flops / 1e12 if self.peak is not None else None
        out["peak_source"] = self.peak.source if self.peak is not None else None
        return out

    @property
    def log_step(self) -> int:
        """The step of the previous log row (or of the start)."""
        return self._log_mark.step

    @property
    def data_wait_seconds(self) -> float:
        """Seconds this process's loop has waited for its batches so far."""
        return self._seconds[DATA]

    def _mark(self, step: int | None = None) -> _Mark:
        if self._events is not None:
            self._forward_device += self._events.collect()
        forward = self._forward_device if self._events is not None else self._seconds[FORWARD]
        tokens = float(self._tokens) if self.tokens_each_step else 0.0
        return _Mark(time.perf_counter(), self.step if step is None else step, list(self._seconds), forward, tokens)

    def _snapshot(self, step: int) -> _Mark:
        """The totals at the lap that just ended, read without waiting for the device: the tokens'
        tensor itself, no forward time (the summary's windows do not read it)."""
        return _Mark(self._last, step, list(self._seconds), 0.0, self._tokens)

    def _window(self, start: _Mark, end: _Mark, training_only: bool = False) -> dict[str, Any]:
        """A row's measurements between two marks: rates over the wall time, or with
        ``training_only`` over the wall time less validation's."""
        wall = max(end.time - start.time, 1e-9)
        steps = end.step - start.step
        per_step = max(steps, 1)
        spent = [b - a for a, b in zip(start.seconds, end.seconds)]
        training = wall - spent[EVAL]  # validation FLOPs are not counted, so neither is its time
        span = max(training, 1e-9) if training_only else wall
        row: dict[str, Any] = {"samples_per_s": steps * self.global_batch / span, "data_wait_share": spent[DATA] / span}
        row |= {name: sum(spent[p] for p in phases) / per_step for name, phases in _COLUMNS.items()}
        if self.tokens_each_step:  # this rank's counted tokens, as many on every data-parallel rank
            row["tokens_per_s"] = (float(end.tokens) - float(start.tokens)) * self.world_size / span
        elif self.tokens_per_step is not None:
            row["tokens_per_s"] = steps * self.tokens_per_step / span
        if self.step_flops and self.peak is not None and steps and training > 0:
            row["mfu"] = self._mfu(self.step_flops * steps * self._real_share(start, end, steps) / training, self.peak)
        return row

    def _real_share(self, start: _Mark, end: _Mark, steps: int) -> float:
        """The share of the window's token positions that are real tokens (1 when not counted step by
        step): padding's FLOPs are work, but not useful work, so MFU leaves them out."""
        if not (self.tokens_each_step and self.positions_per_step):
            return 1.0
        return min(1.0, (float(end.tokens) - float(start.tokens)) * self.world_size / (steps * self.positions_per_step))

    def _mfu(self, flops_per_s: float, peak: Peak) -> float:
        value = flops_per_s / peak.flops
        if value > 1.0 and peak.source.endswith("matmul probe"):  # a disturbed CPU probe: measure again
            self.peak = peak = remeasure_cpu_peak(peak, flops_per_s, _probe_dtype(peak))
            value = flops_per_s / peak.flops
        if value > 1.0 and not self._warned:  # once, not on every row
            self._warned = True
            log.warning("MFU %.2f > 1: the peak (%s) is too low for this device; hint: set telemetry.peak_tflops",
                        value, peak.source)
        return value

    def _memory(self) -> dict[str, float]:
        """Peak since the previous call: CUDA max allocated (reset each time) on GPUs, the
        process's peak resident set on CPU (never reset: the kernel keeps the maximum)."""
        host = _rss_peak_gb()
        if self.device.type == "cuda":
            device_peak = torch.cuda.max_memory_allocated(self.device) / 1e9
            torch.cuda.reset_peak_memory_stats(self.device)
            out = {"mem_peak_gb": device_peak, "mem_rss_gb": host}
        else:
            out = {"mem_peak_gb": host}
        self._mem_peak = max(self._mem_peak, out["mem_peak_gb"])
        return out


def _probe_dtype(peak: Peak) -> torch.dtype:
    """The dtype a CPU probe peak was measured in (named in its source text)."""
    return next((d for d in (torch.bfloat16, torch.float16) if str(d) in peak.source), torch.float32)


def _rss_peak_gb() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 1e9 if sys.platform == "darwin" else peak * 1024 / 1e9  # bytes on macOS, KiB on Linux


class _ForwardEvents:
    """CUDA events around each forward pass (the lap that ends DATA starts one, FORWARD's
    lap ends it), read only at interval ends. Recording an event does not synchronise."""

    def __init__(self) -> None:
        self._pairs: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._used = 0

    def mark(self, phase: int) -> None:
        if phase == DATA:
            if self._used == len(self._pairs):
                self._pairs.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
            self._pairs[self._used][0].record()
        elif phase == FORWARD:
            self._pairs[self._used][1].record()
            self._used += 1

    def collect(self) -> float:
        """Seconds of forward passes recorded since the last call (waits for the last one)."""
        if not self._used:
            return 0.0
        self._pairs[self._used - 1][1].synchronize()
        total = sum(start.elapsed_time(end) for start, end in self._pairs[: self._used]) / 1e3
        self._used = 0
        return total
