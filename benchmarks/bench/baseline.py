"""``hpctrain bench baseline``: the single-process baseline, measured first.

simple_cnn on CIFAR-shaped synthetic data in one process (the GPU if there is one), through
hpctrain's loop as ``hpctrain train`` runs it and through a hand-written PyTorch loop, in
alternating order, from the same initial weights on the same batches (see
:mod:`bench.loops`). Reports both throughputs, their ratio and whether the final
weights were bitwise equal. Timed from the first step, warm-up included, alike for both.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from bench.context import Context
from bench.loops import compare, make_config
from bench.output import BenchResult, fmt, progress


def run(ctx: Context) -> BenchResult:
    batch, steps = ctx.pick(32, 128, 256), ctx.pick(3, 10, 50)
    repeats = ctx.repeats or (2 if ctx.quick else 4)
    cfg = make_config("simple_cnn", "synthetic_cifar", batch, steps, batch * steps)
    raw, hp, equal = compare(cfg, progress(range(repeats), "baseline"), ctx.device)
    samples = batch * steps
    rows = [_row("plain PyTorch loop", raw, samples, steps), _row("hpctrain", hp, samples, steps)]
    ratio = statistics.median(h / r for h, r in zip(hp, raw))
    return BenchResult(
        title=f"baseline: simple_cnn, batch {batch}, {steps} steps, one process on {ctx.device.type}",
        columns=[("loop", "loop"), ("samples_per_s", "samples/s"), ("step_ms", "ms/step"),
                 ("seconds", "s per run (median)")],
        rows=rows, plot=plot,
        settings={"model": "simple_cnn", "data": "synthetic_cifar", "batch": batch, "steps": steps,
                  "repeats": repeats, "device": str(ctx.device), "threads": torch.get_num_threads()},
        summary={"samples_per_s": rows[1]["samples_per_s"], "time_ratio_hpctrain_vs_plain": ratio,
                 "weights_equal": equal},
        notes=["time ratio = median over rounds of hpctrain's time / the plain loop's (1.0 = no overhead)"],
    )


def _row(loop: str, times: list[float], samples: int, steps: int) -> dict[str, Any]:
    seconds = statistics.median(times)
    return {"loop": loop, "samples_per_s": samples / seconds, "step_ms": seconds / steps * 1e3, "seconds": seconds,
            "seconds_per_round": times}


def plot(fig: Any, result: BenchResult) -> None:
    ax = fig.subplots()
    names = [r["loop"] for r in result.rows]
    bars = ax.bar(names, [r["samples_per_s"] for r in result.rows], color=["#999999", "#1f77b4"])
    ax.bar_label(bars, fmt=fmt)
    ax.set(ylabel="samples / s", title=f"time ratio hpctrain / plain = "
           f"{result.summary['time_ratio_hpctrain_vs_plain']:.3f}, weights equal: {result.summary['weights_equal']}")
    ax.grid(axis="y", alpha=0.3)
