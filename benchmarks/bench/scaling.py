"""``hpctrain bench scaling``: 1..N processes, hpctrain against a plain hand-written DDP loop.

Weak scaling: every rank trains simple_cnn on the same per-rank batch of CIFAR-shaped
synthetic data, so N ranks process N times the samples per step. For each N, hpctrain
(``hpctrain train`` under torchrun, DDP on gloo or NCCL) and the plain loop of
:mod:`bench.plain_ddp` (same model, data size, batch, optimizer, threads) run in
the same benchmark, in alternating order (which one goes first flips every round), so a
busy machine's drift hits both alike. Speed-up(N) = samples/s at N / samples/s at 1 of the
same loop; efficiency = speed-up / N. The goal: hpctrain's efficiency >= the plain loop's.

On CPUs the N ranks share the cores: each rank gets cores / N threads (both loops), so on
one machine the ideal speed-up is about 1 and the efficiency about 1/N; what is compared
is the cost of the gradient all-reduce and the loop, not more hardware.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from bench.context import Context
from bench.output import BenchResult, progress
from bench.runner import RunStats, Steps, hpctrain_run, plain_run
from hpctrain.core.errors import UserError
from hpctrain.launch.doctor import cpus

LOOPS = ("plain", "hpctrain")


def max_procs(ctx: Context) -> int:
    if ctx.procs is not None:
        if ctx.gpu and ctx.procs > torch.cuda.device_count():
            raise UserError(f"--procs {ctx.procs}: only {torch.cuda.device_count()} GPU(s) here, one per rank")
        return ctx.procs
    return torch.cuda.device_count() if ctx.gpu else max(2, min(cpus(), 8))  # 2 ranks share 1 core, if need be


def plan(world_sizes: list[int], repeats: int) -> list[tuple[int, str]]:
    """(ranks, loop) in run order: the loop that goes first alternates from point to point."""
    order = []
    for rep in range(repeats):
        for i, n in enumerate(world_sizes):
            order += [(n, loop) for loop in (LOOPS if (rep + i) % 2 == 0 else LOOPS[::-1])]
    return order


def run(ctx: Context) -> BenchResult:
    top = max_procs(ctx)
    sizes = list(range(1, top + 1))
    batch = ctx.pick(8, 64, 256)
    steps = Steps(1, 1) if ctx.quick else Steps(5, 20)
    repeats = ctx.repeats or (1 if ctx.quick else 3)
    samples = steps.total * batch * top  # the same data set at every size: enough for the largest
    stats: dict[tuple[int, str], list[RunStats]] = {(n, loop): [] for n in sizes for loop in LOOPS}
    for i, (n, loop) in enumerate(progress(plan(sizes, repeats), "scaling")):
        threads = max(1, cpus() // n)
        name = f"{loop}-n{n}-{i}"
        if loop == "plain":
            stats[n, loop].append(plain_run(ctx.work, name, [
                f"--batch={batch}", f"--warmup={steps.warmup}", f"--steps={steps.measured}", f"--threads={threads}",
                f"--size={samples}"], n))
        else:
            stats[n, loop].append(hpctrain_run(ctx.work, name, [
                "model.name=simple_cnn", "data.name=synthetic_cifar", f"data.synthetic_size={samples}",
                f"data.batch_size={batch}", f"data.max_val_samples={batch}", f"train.threads={threads}"],
                steps, procs=n))
    rows = table_rows(sizes, stats)
    last = rows[-1]
    return BenchResult(
        title=f"scaling: simple_cnn, batch {batch} per rank, 1..{top} ranks on {ctx.device.type}, "
              "hpctrain vs plain DDP",
        columns=[("ranks", "ranks"), ("plain_samples_per_s", "plain samples/s"),
                 ("hpctrain_samples_per_s", "hpctrain samples/s"), ("plain_speedup", "plain speed-up"),
                 ("hpctrain_speedup", "hpctrain speed-up"), ("plain_efficiency", "plain eff."),
                 ("hpctrain_efficiency", "hpctrain eff.")],
        rows=rows, plot=plot,
        settings={"model": "simple_cnn", "data": "synthetic_cifar", "batch_per_rank": batch,
                  "warmup_steps": steps.warmup, "measured_steps": steps.measured, "repeats": repeats,
                  "threads_per_rank": {n: max(1, cpus() // n) for n in sizes}},
        summary={"ranks": last["ranks"], "hpctrain_efficiency": last["hpctrain_efficiency"],
                 "plain_efficiency": last["plain_efficiency"],
                 "goal_hpctrain_efficiency_ge_plain": last["hpctrain_efficiency"] >= last["plain_efficiency"]},
        notes=["median of the repeats per point; speed-up relative to the same loop at 1 rank; efficiency = "
               "speed-up / ranks", *(["one GPU: nothing to scale across (one rank per GPU)"] if top == 1 else [])],
    )


def table_rows(sizes: list[int], stats: dict[tuple[int, str], list[RunStats]]) -> list[dict[str, Any]]:
    rate = {key: statistics.median(s.samples_per_s for s in runs) for key, runs in stats.items()}
    rows = []
    for n in sizes:
        row: dict[str, Any] = {"ranks": n}
        for loop in LOOPS:
            speedup = rate[n, loop] / rate[1, loop]
            row |= {f"{loop}_samples_per_s": rate[n, loop], f"{loop}_speedup": speedup,
                    f"{loop}_efficiency": speedup / n,
                    f"{loop}_runs_samples_per_s": [s.samples_per_s for s in stats[n, loop]],
                    f"{loop}_peak_mem_gb": max(s.peak_mem_gb for s in stats[n, loop])}
        rows.append(row)
    return rows


def plot(fig: Any, result: BenchResult) -> None:
    rate_ax, eff_ax = fig.subplots(1, 2)
    ranks = [r["ranks"] for r in result.rows]
    for loop, style in (("plain", "s--"), ("hpctrain", "o-")):
        rate_ax.plot(ranks, [r[f"{loop}_samples_per_s"] for r in result.rows], style, label=loop)
        eff_ax.plot(ranks, [r[f"{loop}_efficiency"] for r in result.rows], style, label=loop)
    rate_ax.set(title="throughput (all ranks)", xlabel="ranks", ylabel="samples / s")
    eff_ax.set(title="efficiency = speed-up / ranks", xlabel="ranks", ylabel="efficiency", ylim=(0, None))
    for ax in (rate_ax, eff_ax):
        ax.set_xticks(ranks)
        ax.grid(alpha=0.3)
        ax.legend()
