"""``hpctrain bench amp``: mixed precision against fp32 on resnet18 at a small input.

The input is CIFAR's 3x32x32 on a GPU; on a CPU 3x16x16 (3x8x8 with ``--quick``), where a
32x32 resnet18 step takes seconds. The images come from shards (:mod:`bench.shards`).

fp32 and bf16 (autocast) everywhere, fp16 (autocast + GradScaler) on a GPU only: CPUs
have no fast fp16 path. Each precision is one ``hpctrain train`` run in a fresh process
(``precision=...``); reported: steady-state samples/s, the speed-up over fp32, the peak
memory (CUDA's peak allocated bytes on a GPU, the process's peak RSS on a CPU) and the
last logged training loss, to show each precision trained.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from bench.context import Context
from bench.output import BenchResult, fmt, progress
from bench.runner import RunStats, Steps, hpctrain_run
from bench.shards import image_shards
from hpctrain.telemetry.runs import load_run


def precisions(ctx: Context) -> list[str]:
    if not ctx.gpu:
        return ["fp32", "bf16"]
    return ["fp32", "bf16", "fp16"] if torch.cuda.is_bf16_supported() else ["fp32", "fp16"]


def run(ctx: Context) -> BenchResult:
    batch, side = ctx.pick(4, 32, 256), ctx.pick(8, 16, 32)
    steps = Steps(1, 1) if ctx.quick else Steps(10, 40) if ctx.gpu else Steps(2, 6)
    data = image_shards(ctx.work / "shards", (3, side, side), {"train": steps.total * batch, "val": batch})
    repeats = ctx.repeats or 1
    modes = precisions(ctx)
    plan = [m for rep in range(repeats) for m in (modes if rep % 2 == 0 else modes[::-1])]
    stats: dict[str, list[RunStats]] = {m: [] for m in modes}
    losses: dict[str, float] = {}
    for i, mode in enumerate(progress(plan, "amp")):
        name = f"{mode}-{i}"
        stats[mode].append(hpctrain_run(ctx.work, name, [
            "model.name=resnet18", "data.name=shards", f"data.path={data}", f"data.batch_size={batch}",
            f"precision={mode}"],
            steps))
        losses[mode] = load_run(ctx.work / name).train[-1]["loss"]
    rows = [_row(mode, stats[mode], losses[mode]) for mode in modes]
    for row in rows:
        row["speedup"] = row["samples_per_s"] / rows[0]["samples_per_s"]
    kind = stats["fp32"][0].mem_kind
    return BenchResult(
        title=f"amp: resnet18 3x{side}x{side}, batch {batch}, {', '.join(modes)} on {ctx.device.type}",
        columns=[("precision", "precision"), ("samples_per_s", "samples/s"), ("speedup", "x fp32"),
                 ("peak_mem_gb", f"peak GB ({kind})"), ("loss", "last loss")],
        rows=rows, plot=plot,
        settings={"model": "resnet18", "input": [3, side, side], "batch": batch, "warmup_steps": steps.warmup,
                  "measured_steps": steps.measured, "repeats": repeats, "mem_kind": kind},
        summary={f"{r['precision']}_speedup": r["speedup"] for r in rows[1:]},
    )


def _row(mode: str, stats: list[RunStats], loss: float) -> dict[str, Any]:
    return {"precision": mode, "samples_per_s": statistics.median(s.samples_per_s for s in stats),
            "peak_mem_gb": statistics.median(s.peak_mem_gb for s in stats), "loss": loss}


def plot(fig: Any, result: BenchResult) -> None:
    rate_ax, mem_ax = fig.subplots(1, 2)
    names = [r["precision"] for r in result.rows]
    rate_ax.bar_label(rate_ax.bar(names, [r["samples_per_s"] for r in result.rows]), fmt=fmt)
    rate_ax.set(title="throughput", ylabel="samples / s")
    mem_ax.bar_label(mem_ax.bar(names, [r["peak_mem_gb"] for r in result.rows], color="#ff7f0e"), fmt="%.2f")
    mem_ax.set(title=f"peak memory ({result.settings['mem_kind']})", ylabel="GB")
    for ax in (rate_ax, mem_ax):
        ax.grid(axis="y", alpha=0.3)
