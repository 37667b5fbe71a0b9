"""``hpctrain bench long-context``: context parallel (``parallel.cp``) lets a sequence that does not
fit one rank's memory budget train, split over cp ranks.

A small Llama (``model.name=llama``, grouped-query attention) on byte-level text shards (a
generated corpus), one window per step, trained through ``hpctrain train`` at cp = 1, 2 and 4
(one data-parallel replica: the ranks share each sequence). Reported per cp: steady-state tokens/s;
each rank's measured memory (:mod:`hpctrain.telemetry.memory_breakdown`: the parameters, gradients
and optimizer state it holds, plus the peak bytes saved for backward in its first step), the
estimator's activation bytes for the same cp (:func:`hpctrain.estimate.activations.transformer_bytes`),
and whether the rank's state + activations fit the stated budget (:data:`BUDGET_MB`): at this
sequence length one rank alone does not fit, cp4's ranks do.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.context import Context
from bench.output import BenchResult, fmt, progress
from bench.runner import Steps, hpctrain_run, rank_reports
from bench.strategies import corpus
from hpctrain.core.errors import RunError, UserError
from hpctrain.launch.doctor import cpus

CPS = (1, 2, 4)
PARTS = ("params", "grads", "optimizer", "activations")


@dataclass(frozen=True)
class Size:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    seq_len: int
    budget_mb: float  # one rank's memory budget: state + saved activations, MB = 1e6 bytes

    @classmethod
    def of(cls, ctx: Context) -> Size:
        if ctx.quick:
            return cls(2, 64, 4, 1, 512, 6.0)
        return cls(4, 128, 4, 1, 2048, 64.0)

    def overrides(self, data: Path, cp: int) -> list[str]:
        return ["model.name=llama", f"model.n_layers={self.layers}", f"model.hidden={self.hidden}",
                f"model.heads={self.heads}", f"model.kv_heads={self.kv_heads}", f"model.seq_len={self.seq_len}",
                "data.name=shards", f"data.path={data}", "data.batch_size=1", "data.max_val_samples=1",
                "optim.name=adamw", f"parallel.cp={cp}", f"train.threads={max(1, cpus() // cp)}"]


def _predicted_mb(size: Size, cp: int) -> float:
    """The estimator's saved-activation bytes of one rank (fp32, flash attention: no s x s scores)."""
    from hpctrain.estimate.activations import transformer_bytes
    from hpctrain.models.llama import LlamaShape

    shape = LlamaShape(vocab=256, seq_len=size.seq_len, n_layers=size.layers, hidden=size.hidden, heads=size.heads,
                       kv_heads=size.kv_heads).transformer()
    return transformer_bytes(shape, 1, element_bytes=4, recompute="selective", cp=cp) / 1e6


def run(ctx: Context) -> BenchResult:
    if ctx.gpu:
        raise UserError("hpctrain bench long-context is the CPU demo (gloo ranks); on GPUs run hpctrain train with "
                        "parallel.cp=N at your sequence length")
    size = Size.of(ctx)
    steps = Steps(1, 2) if ctx.quick else Steps(1, 4)
    data = corpus(ctx.work, (steps.total + 2) * size.seq_len, size.seq_len)
    rows: list[dict[str, Any]] = []
    for cp in progress(list(CPS), "long-context"):
        rows.append(_row(ctx.work, size, cp, data, steps))
    fits = {r["cp"]: r["fits"] for r in rows}
    return BenchResult(
        title=f"long context: llama {size.layers}x{size.hidden} (kv_heads {size.kv_heads}), seq {size.seq_len}, one "
              f"window per step, AdamW fp32, budget {size.budget_mb:g} MB per rank, on {ctx.device.type}",
        columns=[("cp", "cp"), ("tokens_per_s", "tokens/s"), ("state_mb", "state MB/rank"),
                 ("activations_mb", "activations MB/rank"), ("predicted_mb", "estimated act. MB"),
                 ("total_mb", "state+act. MB/rank"), ("fits", f"fits {size.budget_mb:g} MB"), ("status", "status")],
        rows=rows, plot=plot,
        settings={"model": {"n_layers": size.layers, "hidden": size.hidden, "heads": size.heads,
                            "kv_heads": size.kv_heads, "seq_len": size.seq_len}, "batch": 1,
                  "budget_mb": size.budget_mb, "warmup_steps": steps.warmup, "measured_steps": steps.measured},
        summary={"fits_without_cp": fits.get(1), "fits_with_cp4": fits.get(4)},
        notes=["state = parameters + gradients + AdamW state the largest rank holds (every cp rank holds all of "
               "them: cp splits the sequence, not the weights); activations = the peak bytes autograd saved for "
               "backward in its first step (saved-tensor hooks); MB = 1e6 bytes",
               "estimated = hpctrain.estimate.activations.transformer_bytes(..., cp=cp): every tensor / cp except "
               "the keys and values each attention layer gathers whole, plus one s/cp x s mask",
               "tokens/s = steady-state samples/s x seq_len (one replica: the cp ranks share each window)"],
    )


def _row(work: Path, size: Size, cp: int, data: Path, steps: Steps) -> dict[str, Any]:
    row: dict[str, Any] = {"cp": cp, "status": "ok", "predicted_mb": _predicted_mb(size, cp)}
    name = f"cp{cp}"
    try:
        stats = hpctrain_run(work, name, size.overrides(data, cp), steps, procs=cp)
    except RunError as err:
        causes = [line.strip() for line in str(err).splitlines() if "Error" in line] or [str(err)]
        return {**row, "status": f"failed: {causes[0]}", "fits": None}
    rank_reports(work / f"{name}.report")  # every rank reported
    breakdown = (stats.summary or {}).get("memory_breakdown") or []
    per_part = {p: max(r[f"{p}_bytes"] for r in breakdown) / 1e6 for p in PARTS} if breakdown else {}
    state = sum(per_part.get(p, 0.0) for p in PARTS[:3])
    total = state + per_part.get("activations", 0.0)
    row.update(tokens_per_s=stats.samples_per_s * size.seq_len, state_mb=state,
               activations_mb=per_part.get("activations"), total_mb=total, fits=total <= size.budget_mb,
               per_rank_total_mb=[sum(r[f"{p}_bytes"] for p in PARTS) / 1e6 for r in breakdown])
    return row


def plot(fig: Any, result: BenchResult) -> None:
    mem_ax, rate_ax = fig.subplots(1, 2)
    rows = [r for r in result.rows if r.get("total_mb") is not None]
    names = [f"cp{r['cp']}" for r in rows]
    mem_ax.bar(names, [r["state_mb"] for r in rows], label="state (params, grads, AdamW)")
    mem_ax.bar(names, [r["activations_mb"] for r in rows], bottom=[r["state_mb"] for r in rows],
               label="saved activations")
    mem_ax.plot(names, [r["state_mb"] + r["predicted_mb"] for r in rows], "k_", markersize=30,
                label="state + estimated activations")
    mem_ax.axhline(result.settings["budget_mb"], color="red", linestyle="--", label="budget per rank")
    mem_ax.set(title="memory per rank, as measured", ylabel="MB")
    mem_ax.legend(fontsize="small")
    rate_ax.bar_label(rate_ax.bar(names, [r["tokens_per_s"] for r in rows]), fmt=fmt, fontsize="small")
    rate_ax.set(title="throughput (one replica)", ylabel="tokens / s")
    for ax in (mem_ax, rate_ax):
        ax.grid(axis="y", alpha=0.3)
