"""``hpctrain bench workers``: DataLoader worker processes against throughput, from shards.

simple_cnn trained from tar shards of 3x32x32 images (``data.name=shards``) with
``data.num_workers`` = 0, 1, 2, 4, 8, one ``hpctrain train`` run each in a fresh process:
steady-state samples/s and the share of the step spent waiting for data. The samples are
raw ``.npy`` (no image decode), so what workers can hide is reading and collating;
more workers than idle cores only compete with the training step for the CPU.
"""

from __future__ import annotations

import statistics
from typing import Any

from bench.context import Context
from bench.output import BenchResult, progress
from bench.runner import RunStats, Steps, hpctrain_run
from bench.shards import image_shards


def worker_counts(ctx: Context) -> list[int]:
    return [0, 1] if ctx.quick else [0, 1, 2, 4, 8]


def run(ctx: Context) -> BenchResult:
    counts = worker_counts(ctx)
    batch = ctx.pick(8, 64, 256)
    steps = Steps(1, 1) if ctx.quick else Steps(5, 20)
    repeats = ctx.repeats or 1
    data = image_shards(ctx.work / "shards", (3, 32, 32), {"train": steps.total * batch, "val": batch})
    plan = [w for rep in range(repeats) for w in (counts if rep % 2 == 0 else counts[::-1])]
    stats: dict[int, list[RunStats]] = {w: [] for w in counts}
    for i, workers in enumerate(progress(plan, "workers")):
        stats[workers].append(hpctrain_run(ctx.work, f"w{workers}-{i}", [
            "model.name=simple_cnn", "data.name=shards", f"data.path={data}", f"data.batch_size={batch}",
            f"data.num_workers={workers}"], steps))
    rows = [_row(w, stats[w]) for w in counts]
    best = max(rows, key=lambda r: r["samples_per_s"])
    return BenchResult(
        title=f"workers: simple_cnn from .npy shards, batch {batch}, num_workers {counts} on {ctx.device.type}",
        columns=[("workers", "num_workers"), ("samples_per_s", "samples/s"), ("data_wait_share", "data wait"),
                 ("peak_mem_gb", "peak GB, main process")],
        rows=rows, plot=plot,
        settings={"model": "simple_cnn", "data": "shards (.npy 3x32x32)", "batch": batch, "workers": counts,
                  "warmup_steps": steps.warmup, "measured_steps": steps.measured, "repeats": repeats,
                  "mem_kind": stats[counts[0]][0].mem_kind},
        summary={"fastest_workers": best["workers"], "fastest_samples_per_s": best["samples_per_s"]},
        notes=["data wait = share of the step's wall time spent waiting for the next batch (steady state)"],
    )


def _row(workers: int, stats: list[RunStats]) -> dict[str, Any]:
    waits = [s.data_wait_share for s in stats if s.data_wait_share is not None]
    return {"workers": workers, "samples_per_s": statistics.median(s.samples_per_s for s in stats),
            "data_wait_share": statistics.median(waits) if waits else None,
            "peak_mem_gb": statistics.median(s.peak_mem_gb for s in stats)}


def plot(fig: Any, result: BenchResult) -> None:
    rate_ax, wait_ax = fig.subplots(1, 2)
    counts = [r["workers"] for r in result.rows]
    rate_ax.plot(counts, [r["samples_per_s"] for r in result.rows], marker="o")
    rate_ax.set(title="throughput", xlabel="data.num_workers", ylabel="samples / s")
    wait_ax.plot(counts, [r["data_wait_share"] or 0.0 for r in result.rows], marker="o", color="#d62728")
    wait_ax.set(title="share of time waiting for data", xlabel="data.num_workers", ylabel="share", ylim=(0, None))
    for ax in (rate_ax, wait_ax):
        ax.set_xticks(counts)
        ax.grid(alpha=0.3)
