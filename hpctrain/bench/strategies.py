"""``hpctrain bench strategies``: ddp / zero1 / fsdp on the same GPT, tokens/s and memory per rank.

A small decoder-only GPT (``model.name=gpt``) trained with AdamW on byte-level text shards
(a generated corpus, packed by :func:`hpctrain.data.text.write_text_shards`), on N ranks,
once per ``parallel.strategy``: ddp (everything replicated), zero1 (optimizer state
sharded) and fsdp (FSDP2: parameters, gradients and optimizer state sharded). Reported:
steady-state tokens/s over all ranks and the peak memory of each rank (CUDA's peak
allocated bytes on GPUs; the process's peak RSS on CPUs, where the sharded states are a
part of a few hundred MB of interpreter and libraries).
"""

from __future__ import annotations

import statistics
import typing
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hpctrain.bench.context import Context
from hpctrain.bench.output import BenchResult, fmt, progress
from hpctrain.bench.runner import Steps, hpctrain_run, rank_reports
from hpctrain.errors import UserError
from hpctrain.launch.doctor import cpus

STRATEGIES = ("ddp", "zero1", "fsdp")


def missing_support() -> str | None:
    """Why this hpctrain cannot run the case, or None."""
    from hpctrain.models import REGISTRY
    from hpctrain.parallel import config

    offered = typing.get_args(getattr(config, "Strategy", None)) or ("ddp",)
    lacking = [s for s in STRATEGIES if s not in offered]
    if lacking or "gpt" not in REGISTRY:
        return (f"hpctrain bench strategies needs parallel.strategy support (issue 10): this hpctrain offers "
                f"parallel.strategy={'|'.join(offered)}" + ("" if "gpt" in REGISTRY else " and no gpt model"))
    return None


def world(ctx: Context) -> int:
    if ctx.gpu:
        gpus = torch.cuda.device_count()
        if gpus < 2:
            raise UserError(f"hpctrain bench strategies needs 2 or more GPUs (one per rank); {gpus} visible")
        return min(ctx.procs or gpus, gpus)
    return ctx.procs or max(2, min(cpus(), 4))


def corpus(root: Path, tokens: int, seq_len: int) -> Path:
    """Byte-level text shards holding at least ``tokens`` training tokens (10 documents, one for val)."""
    from hpctrain.data.text import write_text_shards

    docs = root / "corpus"
    docs.mkdir(parents=True)
    rng = np.random.default_rng(0)
    alphabet = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz     \n", dtype=np.uint8)
    size = (tokens // 9 // seq_len + 2) * seq_len + 1
    for i in range(10):
        (docs / f"doc{i:02d}.txt").write_bytes(alphabet[rng.integers(0, len(alphabet), size)].tobytes())
    write_text_shards(f"text:{docs}", root / "shards", seq_len=seq_len)
    return root / "shards"


def run(ctx: Context) -> BenchResult:
    reason = missing_support()
    if reason:
        raise UserError(reason)
    ranks = world(ctx)
    layers, hidden, seq_len, batch = (2, 64, 32, 4) if ctx.quick else (4, 256, 128, 16) if ctx.gpu else (4, 384, 64, 8)
    steps = Steps(1, 1) if ctx.quick else Steps(5, 20) if ctx.gpu else Steps(3, 12)
    repeats = ctx.repeats or 1
    data = corpus(ctx.work, steps.total * batch * ranks * seq_len, seq_len)
    plan = [s for rep in range(repeats) for s in (STRATEGIES if rep % 2 == 0 else STRATEGIES[::-1])]
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in STRATEGIES}
    for i, strategy in enumerate(progress(plan, "strategies")):
        name = f"{strategy}-{i}"
        stats = hpctrain_run(ctx.work, name, [
            "model.name=gpt", f"model.n_layers={layers}", f"model.hidden={hidden}", f"model.seq_len={seq_len}",
            "data.name=shards", f"data.path={data}", f"data.batch_size={batch}", f"data.max_val_samples={batch}",
            "optim.name=adamw", f"parallel.strategy={strategy}", f"train.threads={max(1, cpus() // ranks)}"],
            steps, procs=ranks)
        per_rank = [r["peak_mem_gb"] for r in sorted(rank_reports(ctx.work / f"{name}.report"),
                                                     key=lambda r: r["rank"])]
        runs[strategy].append({"tokens_per_s": stats.samples_per_s * seq_len, "per_rank": per_rank,
                               "kind": stats.mem_kind})
    rows = [_row(s, runs[s]) for s in STRATEGIES]
    kind = runs["ddp"][0]["kind"]
    return BenchResult(
        title=f"strategies: gpt {layers}x{hidden}, seq {seq_len}, batch {batch} per rank, {ranks} ranks on "
              f"{ctx.device.type}",
        columns=[("strategy", "strategy"), ("tokens_per_s", "tokens/s"), ("mem_max_gb", f"max GB/rank ({kind})"),
                 ("mem_per_rank_gb", "GB per rank")],
        rows=rows, plot=plot,
        settings={"model": {"n_layers": layers, "hidden": hidden, "seq_len": seq_len}, "batch_per_rank": batch,
                  "ranks": ranks, "optimizer": "adamw", "warmup_steps": steps.warmup,
                  "measured_steps": steps.measured, "repeats": repeats, "mem_kind": kind},
        summary={f"{r['strategy']}_mem_vs_ddp": r["mem_max_gb"] / rows[0]["mem_max_gb"] for r in rows[1:]},
        notes=["tokens/s = steady-state samples/s x seq_len, over all ranks"],
    )


def _row(strategy: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    per_rank = [statistics.median(r["per_rank"][i] for r in runs) for i in range(len(runs[0]["per_rank"]))]
    return {"strategy": strategy, "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
            "mem_max_gb": max(per_rank), "mem_per_rank_gb": per_rank}


def plot(fig: Any, result: BenchResult) -> None:
    rate_ax, mem_ax = fig.subplots(1, 2)
    names = [r["strategy"] for r in result.rows]
    rate_ax.bar_label(rate_ax.bar(names, [r["tokens_per_s"] for r in result.rows]), fmt=fmt)
    rate_ax.set(title="throughput (all ranks)", ylabel="tokens / s")
    ranks = len(result.rows[0]["mem_per_rank_gb"])
    width = 0.8 / ranks
    for k in range(ranks):
        xs = [i + (k - (ranks - 1) / 2) * width for i in range(len(names))]
        mem_ax.bar(xs, [r["mem_per_rank_gb"][k] for r in result.rows], width, label=f"rank {k}")
    mem_ax.set_xticks(range(len(names)), names)
    mem_ax.set(title=f"peak memory per rank ({result.settings['mem_kind']})", ylabel="GB")
    mem_ax.legend(fontsize="small", loc="lower right")
    for ax in (rate_ax, mem_ax):
        ax.grid(axis="y", alpha=0.3)
