"""``hpctrain bench strategies``: every parallel strategy on the same GPT, in one run: tokens/s
and memory per rank, the memory broken into parameters / gradients / optimizer state /
activations as measured.

A small decoder-only GPT (``model.name=gpt``, untied embeddings so that pipeline stages hold
the same parameters) trained with AdamW on byte-level text shards (a generated corpus), on
N ranks, once per case, each through ``hpctrain train`` in fresh processes: ddp, zero1,
fsdp-zero2 (``reshard_after_forward=false``), fsdp-zero3, fsdp-offload (``cpu_offload=true``: sharded
state in host memory), deepspeed-1/2/3, tp2 and pp2
(with fsdp over the data-parallel ranks where N > 2). Reported per case: steady-state
tokens/s over all ranks and relative to ddp in the same run; each rank's peak memory (CUDA's
peak allocated bytes on GPUs, the process's peak RSS on CPUs); and each rank's
``memory_breakdown`` from the run's summary (:mod:`hpctrain.telemetry.memory_breakdown`): the bytes of
the tensors it holds after its first optimizer step, and the peak bytes saved for backward.

A case the installed hpctrain refuses (its own config and strategy checks, as ``hpctrain
train`` runs them before starting) is listed as ``refused: <message>``; DeepSpeed missing, as
``skipped: <reason>``; a run that fails, as ``failed: <cause>`` (the end of its log in the
JSON's details), and the other cases still run.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.context import Context
from bench.output import BenchResult, fmt, progress
from bench.runner import BASE_OVERRIDES, Steps, hpctrain_run, rank_reports
from hpctrain.core.errors import RunError, UserError
from hpctrain.launch.doctor import cpus

PARTS = ("params", "grads", "optimizer", "activations")  # memory_breakdown's parts, in the table's order
QUICK = ("ddp", "fsdp-zero3")  # CI: the bench's own path; every strategy's bytes per rank are
# tests/estimate/test_strategy_memory_declared.py's matrix (in-process, against the declaration)


@dataclass(frozen=True)
class Case:
    name: str
    overrides: tuple[str, ...]


def cases(world: int, quick: bool) -> list[Case]:
    """The strategies at ``world`` ranks; tp2 / pp2 run beside fsdp over dp = world / 2 when world > 2."""
    over_dp = ("parallel.strategy=fsdp",) if world > 2 else ()
    every = [
        Case("ddp", ("parallel.strategy=ddp",)),
        Case("zero1", ("parallel.strategy=zero1",)),
        Case("fsdp-zero2", ("parallel.strategy=fsdp", "parallel.reshard_after_forward=false")),
        Case("fsdp-zero3", ("parallel.strategy=fsdp",)),
        Case("fsdp-offload", ("parallel.strategy=fsdp", "parallel.cpu_offload=true")),
        *(Case(f"deepspeed-{k}", ("parallel.strategy=deepspeed", f"parallel.deepspeed_stage={k}")) for k in (1, 2, 3)),
        Case("tp2", ("parallel.tp=2", *over_dp)),
        Case("pp2", ("parallel.pp=2", "parallel.microbatches=2", *over_dp)),
    ]
    return [c for c in every if c.name in QUICK] if quick else every


def world(ctx: Context) -> int:
    if ctx.gpu:
        gpus = torch.cuda.device_count()
        if gpus < 2:
            raise UserError(f"hpctrain bench strategies needs 2 or more GPUs (one per rank); {gpus} visible")
        return min(ctx.procs or gpus, gpus)
    return ctx.procs or max(2, min(cpus(), 4))


def refusal(overrides: list[str], ranks: int) -> str | None:
    """Why the installed ``hpctrain train`` would refuse these overrides at ``ranks`` ranks (its
    own checks, in the order it runs them before starting), or None: ``refused: ...`` or
    ``skipped: ...`` (DeepSpeed not installed)."""
    from hpctrain.config import load_config
    from hpctrain.core.env import ClusterEnv
    from hpctrain.parallel.deepspeed import DeepSpeedMissing
    from hpctrain.planning.layout import make_layout

    env = ClusterEnv(world_size=ranks, local_world_size=ranks, source="torchrun")
    try:
        make_layout(load_config(None, [*BASE_OVERRIDES, *overrides]), env)
    except DeepSpeedMissing as err:
        return f"skipped: {err}"
    except UserError as err:
        return f"refused: {err}"
    return None


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


@dataclass(frozen=True)
class Size:
    layers: int
    hidden: int
    seq_len: int
    batch: int  # per data-parallel rank

    @classmethod
    def of(cls, ctx: Context) -> Size:
        return cls(2, 64, 32, 4) if ctx.quick else cls(4, 256, 128, 16) if ctx.gpu else cls(4, 256, 64, 8)

    def overrides(self, data: Path, ranks: int) -> list[str]:
        return ["model.name=gpt", f"model.n_layers={self.layers}", f"model.hidden={self.hidden}",
                f"model.seq_len={self.seq_len}", "model.tie_weights=false", "data.name=shards", f"data.path={data}",
                f"data.batch_size={self.batch}", f"data.max_val_samples={self.batch}", "optim.name=adamw",
                f"train.threads={max(1, cpus() // ranks)}"]


def run(ctx: Context) -> BenchResult:
    ranks, size = world(ctx), Size.of(ctx)
    steps = Steps(1, 1) if ctx.quick else Steps(5, 20) if ctx.gpu else Steps(2, 8)
    repeats = ctx.repeats or 1
    todo = cases(ranks, ctx.quick)
    verdicts = {c.name: refusal([*size.overrides(Path("."), ranks), *c.overrides], ranks) for c in todo}
    runnable = [c for c in todo if verdicts[c.name] is None]
    if not any(c.name == "ddp" for c in runnable):
        raise UserError(f"hpctrain bench strategies: the ddp baseline is refused at {ranks} ranks: {verdicts['ddp']}")
    data = corpus(ctx.work, steps.total * size.batch * ranks * size.seq_len, size.seq_len)
    plan = [c for rep in range(repeats) for c in (runnable if rep % 2 == 0 else runnable[::-1])]
    runs: dict[str, list[dict[str, Any]]] = {c.name: [] for c in runnable}
    failed_logs: dict[str, list[str]] = {}  # the scratch directory goes: the JSON keeps the end of each failed log
    for i, case in enumerate(progress(plan, "strategies")):
        name = f"{case.name}-{i}"
        try:
            runs[case.name].append(_measure(ctx.work, name, [*size.overrides(data, ranks), *case.overrides], steps,
                                            ranks))
        except RunError as err:
            causes = [line.strip() for line in str(err).splitlines() if "Error" in line] or [str(err)]
            verdicts[case.name] = f"failed: {causes[0]}"
            failed_logs[case.name] = (ctx.work / f"{name}.log").read_text(errors="replace").splitlines()[-30:]
    rows = _rows(todo, runs, verdicts)
    kind = next((r["kind"] for rs in runs.values() for r in rs), "peak_rss")
    return BenchResult(
        title=f"strategies: gpt {size.layers}x{size.hidden}, seq {size.seq_len}, batch {size.batch} per data-parallel "
              f"rank, AdamW fp32, {ranks} ranks on {ctx.device.type}",
        columns=[("strategy", "strategy"), ("tokens_per_s", "tokens/s"), ("tokens_vs_ddp", "vs ddp"),
                 *((f"{p}_mb", f"{p} MB") for p in PARTS), ("mem_max_gb", f"max GB/rank ({kind})"),
                 ("status", "status")],
        rows=rows, plot=plot,
        settings={"model": {"n_layers": size.layers, "hidden": size.hidden, "seq_len": size.seq_len,
                            "tie_weights": False}, "batch_per_dp_rank": size.batch, "ranks": ranks,
                  "optimizer": "adamw", "precision": "fp32", "warmup_steps": steps.warmup,
                  "measured_steps": steps.measured, "repeats": repeats, "mem_kind": kind},
        summary=_summary(rows),
        notes=["tokens/s = steady-state samples/s x seq_len over all ranks; vs ddp = the same run's ddp",
               "params/grads/optimizer MB: bytes of the tensors the largest rank holds after its first optimizer "
               "step (each storage once, padding included); activations MB: the peak bytes autograd saved for "
               "backward in that step (parameters left out); MB = 1e6 bytes"],
        details={"memory_breakdown": {name: rs[0]["breakdown"] for name, rs in runs.items() if rs},
                 "failed_logs": failed_logs},
    )


def _measure(work: Path, name: str, overrides: list[str], steps: Steps, ranks: int) -> dict[str, Any]:
    """One case's run (RunError if it fails): tokens/s, peak memory per rank, the memory breakdown."""
    stats = hpctrain_run(work, name, overrides, steps, procs=ranks)
    reports = sorted(rank_reports(work / f"{name}.report"), key=lambda r: r["rank"])
    summary = stats.summary or {}
    seq_len = int(next(o.split("=")[1] for o in overrides if o.startswith("model.seq_len=")))
    return {"tokens_per_s": stats.samples_per_s * seq_len, "per_rank": [r["peak_mem_gb"] for r in reports],
            "kind": stats.mem_kind, "breakdown": summary.get("memory_breakdown")}


def _rows(todo: list[Case], runs: dict[str, list[dict[str, Any]]],
          verdicts: dict[str, str | None]) -> list[dict[str, Any]]:
    rows = [_row(c.name, runs.get(c.name, []), verdicts[c.name]) for c in todo]
    base = next((r["tokens_per_s"] for r in rows if r["strategy"] == "ddp"), None)
    for row in rows:
        row["tokens_vs_ddp"] = row["tokens_per_s"] / base if base and row["tokens_per_s"] else None
    return rows


def _row(name: str, runs: list[dict[str, Any]], verdict: str | None) -> dict[str, Any]:
    row: dict[str, Any] = {"strategy": name, "status": verdict or "ok", "tokens_per_s": None, "mem_max_gb": None,
                           "mem_per_rank_gb": None, "breakdown": None, **{f"{p}_mb": None for p in PARTS}}
    if verdict or not runs:
        return row
    per_rank = [statistics.median(r["per_rank"][i] for r in runs) for i in range(len(runs[0]["per_rank"]))]
    row.update(tokens_per_s=statistics.median(r["tokens_per_s"] for r in runs), mem_max_gb=max(per_rank),
               mem_per_rank_gb=per_rank, breakdown=runs[0]["breakdown"])
    if row["breakdown"]:  # the bytes are deterministic: the first run's
        row.update({f"{p}_mb": max(r[f"{p}_bytes"] for r in row["breakdown"]) / 1e6 for p in PARTS})
    return row


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Each case's parameter + gradient + optimizer bytes (largest rank) relative to ddp's."""
    state = {r["strategy"]: sum(r[f"{p}_mb"] for p in PARTS[:3]) for r in rows if r["params_mb"] is not None}
    out: dict[str, Any] = {"cases_ok": sum(r["status"] == "ok" for r in rows), "cases": len(rows)}
    if "ddp" in state:
        out.update({f"{name}_state_vs_ddp": mb / state["ddp"] for name, mb in state.items() if name != "ddp"})
    return out


def plot(fig: Any, result: BenchResult) -> None:
    rate_ax, mem_ax = fig.subplots(1, 2)
    rows = [r for r in result.rows if r["tokens_per_s"] is not None]
    names = [r["strategy"] for r in rows]
    rate_ax.bar_label(rate_ax.bar(names, [r["tokens_per_s"] for r in rows]), fmt=fmt, fontsize="x-small")
    rate_ax.set(title="throughput (all ranks)", ylabel="tokens / s")
    bottom = [0.0] * len(rows)
    for part in PARTS:
        heights = [r[f"{part}_mb"] or 0.0 for r in rows]
        mem_ax.bar(names, heights, bottom=bottom, label=part)
        bottom = [b + h for b, h in zip(bottom, heights)]
    mem_ax.set(title="memory of the largest rank, as measured", ylabel="MB")
    mem_ax.legend(fontsize="small")
    for ax in (rate_ax, mem_ax):
        ax.grid(axis="y", alpha=0.3)
        ax.tick_params(axis="x", labelrotation=45, labelsize="small")
