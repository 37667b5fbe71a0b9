"""``hpctrain bench batch``: batch size against throughput and memory.

simple_cnn on CIFAR-shaped synthetic data, one ``hpctrain train`` run per batch size in a
fresh process: steady-state samples/s, time per step and peak memory (CUDA's peak
allocated bytes on a GPU, the process's peak RSS on a CPU, which includes the data set
held in memory: the same for every point). A larger batch keeps the device busier until
the throughput flattens, while activation memory grows linearly.
"""

from __future__ import annotations

import statistics
from typing import Any

from bench.context import Context
from bench.output import BenchResult, progress
from bench.runner import RunStats, Steps, hpctrain_run


def batch_sizes(ctx: Context) -> list[int]:
    if ctx.quick:
        return [4, 16]
    return [64, 128, 256, 512, 1024] if ctx.gpu else [16, 32, 64, 128, 256]


def run(ctx: Context) -> BenchResult:
    sizes = batch_sizes(ctx)
    steps = Steps(1, 1) if ctx.quick else Steps(5, 20) if ctx.gpu else Steps(2, 6)
    repeats = ctx.repeats or 1
    samples = steps.total * max(sizes)  # one data set for every point
    plan = [b for rep in range(repeats) for b in (sizes if rep % 2 == 0 else sizes[::-1])]
    stats: dict[int, list[RunStats]] = {b: [] for b in sizes}
    for i, batch in enumerate(progress(plan, "batch")):
        stats[batch].append(hpctrain_run(ctx.work, f"b{batch}-{i}", [
            "model.name=simple_cnn", "data.name=synthetic_cifar", f"data.synthetic_size={samples}",
            f"data.batch_size={batch}", f"data.max_val_samples={min(sizes)}"], steps))
    rows = [_row(b, stats[b]) for b in sizes]
    kind = stats[sizes[0]][0].mem_kind
    best = max(rows, key=lambda r: r["samples_per_s"])
    return BenchResult(
        title=f"batch: simple_cnn 3x32x32, batch {sizes[0]}..{sizes[-1]} on {ctx.device.type}",
        columns=[("batch", "batch"), ("samples_per_s", "samples/s"), ("step_ms", "ms/step"),
                 ("peak_mem_gb", f"peak GB ({kind})")],
        rows=rows, plot=plot,
        settings={"model": "simple_cnn", "data": "synthetic_cifar", "batch_sizes": sizes,
                  "warmup_steps": steps.warmup, "measured_steps": steps.measured, "repeats": repeats,
                  "mem_kind": kind},
        summary={"fastest_batch": best["batch"], "fastest_samples_per_s": best["samples_per_s"]},
    )


def _row(batch: int, stats: list[RunStats]) -> dict[str, Any]:
    rate = statistics.median(s.samples_per_s for s in stats)
    return {"batch": batch, "samples_per_s": rate, "step_ms": batch / rate * 1e3,
            "peak_mem_gb": statistics.median(s.peak_mem_gb for s in stats)}


def plot(fig: Any, result: BenchResult) -> None:
    rate_ax, mem_ax = fig.subplots(1, 2)
    batches = [r["batch"] for r in result.rows]
    rate_ax.plot(batches, [r["samples_per_s"] for r in result.rows], marker="o")
    rate_ax.set(title="throughput", xlabel="batch size", ylabel="samples / s", xscale="log")
    mem_ax.plot(batches, [r["peak_mem_gb"] for r in result.rows], marker="o", color="#ff7f0e")
    mem_ax.set(title=f"peak memory ({result.settings['mem_kind']})", xlabel="batch size", ylabel="GB",
               xscale="log")
    for ax in (rate_ax, mem_ax):
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.grid(alpha=0.3)
