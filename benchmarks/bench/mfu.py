"""``hpctrain bench mfu``: hpctrain's trainer beside torchtitan's on the same Llama, in one run:
tokens/s, MFU and peak memory; then fp8 (torchao float8) against bf16 in hpctrain.

The model is ``model.name=llama`` at Llama 3.2 1B's shape on a GPU (16 blocks of width 2048,
32 query / 8 key-value heads, SwiGLU 8192, vocabulary 128,256, tied embeddings: 1.24 B
parameters), sequence 2048, 4 sequences per step, AdamW (torchtitan's betas 0.9/0.95, weight
decay 0.1, eps 1e-8), gradient clipping at 1.0, constant lr, no activation checkpointing,
``torch.compile`` on, one GPU. torchtitan trains the same shape through its own ``Trainer``
and ``Llama3Model`` (:mod:`bench.mfu_titan`); both read the same token windows
(:mod:`bench.mfu_data`) in the same order. On a CPU, and with ``--quick``, a tiny
model of the same layout runs without compile: the plumbing, not a performance figure.

Rows, each a fresh process (peak memory is per process):

* ``hpctrain bf16``: ``hpctrain train ... precision=bf16`` (autocast);
* ``torchtitan bf16``: FSDP2 with bf16 parameters and fp32 reduction, as torchtitan always
  applies it, also on one GPU; skipped, with the reason, where torchtitan cannot run (not
  installed, or no GPU: its device helpers assume one);
* ``hpctrain fp8``: ``precision=fp8`` (:mod:`hpctrain.precision`), on compute capability >= 9.0
  only; elsewhere skipped with the reason ``hpctrain train`` itself gives (exit 2).

Reported: steady-state tokens/s (the steps after the warm-up, timed between device syncs),
the speed-up over hpctrain bf16, MFU, peak memory (CUDA's peak allocated bytes on a GPU, the
peak RSS on a CPU) and the loss at the last logged step. MFU is the model FLOPs of hpctrain's
estimator (:func:`hpctrain.estimate.flops.model_flops`: 6 x the parameters a token multiplies
by + attention's 12 x layers x width x sequence per token) over the GPU's dense bf16 peak from
:mod:`hpctrain.telemetry.accelerators`, for every row, fp8 included (the convention torchtitan follows):
no FLOP counts from the trainers themselves, so both are measured alike. On a CPU, and on a GPU
the peak table lacks, MFU is not reported (``-``): a CPU has no datasheet peak to hold it against.

fp8's loss parity: the two hpctrain runs start from the same weights and read the same
windows, so their losses at the same logged steps are comparable; parity holds when the mean
of fp8's differs from bf16's by at most :data:`FP8_LOSS_TOLERANCE` of it.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from bench.context import Context
from bench.mfu_data import WindowSpec, write_spec
from bench.output import BenchResult, fmt, progress
from bench.runner import Steps, command, hpctrain_run, launch, rank_reports
from hpctrain.core.errors import UserError
from hpctrain.estimate.flops import model_flops
from hpctrain.models.llama import LlamaShape
from hpctrain.precision import check_fp8

FP8_LOSS_TOLERANCE = 0.03  # |mean fp8 loss - mean bf16 loss| / mean bf16 loss over the same logged steps
GOAL_RATIO, GOAL_MFU = 0.97, 0.45  # issue 18: within 3% of torchtitan's tokens/s; MFU >= 45% at >= 1B parameters


@dataclass(frozen=True)
class Preset:
    """The model, batch and steps of one mode of the bench."""

    name: str
    shape: LlamaShape
    batch: int
    steps: Steps
    compile: bool
    lr: float = 3e-4


GPU = Preset("llama3.2-1b", LlamaShape(vocab=128_256, seq_len=2048, n_layers=16, hidden=2048, heads=32, kv_heads=8,
                                       ffn_hidden=8192, tie_weights=True), batch=4, steps=Steps(10, 40), compile=True)
# compile off on a CPU: inductor's C++ build of every block would take minutes on 2 cores
CPU = Preset("tiny", LlamaShape(vocab=256, seq_len=128, n_layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=256),
             batch=4, steps=Steps(2, 4), compile=False, lr=3e-3)
QUICK = Preset("tiny", LlamaShape(vocab=256, seq_len=32, n_layers=2, hidden=32, heads=4, kv_heads=2, ffn_hidden=64),
               batch=2, steps=Steps(1, 2), compile=False, lr=3e-3)


def preset(ctx: Context) -> Preset:
    return QUICK if ctx.quick else GPU if ctx.gpu else CPU


def flops_per_token(shape: LlamaShape) -> float:
    """Model FLOPs of one trained token (forward + backward), attention included: MFU's numerator."""
    return model_flops(shape.transformer(), 1.0)


def mfu(tokens_per_s: float, shape: LlamaShape, peak_flops: float | None) -> float | None:
    """Model FLOPs utilisation of one device; None without a peak to hold it against."""
    if peak_flops is None or peak_flops <= 0:
        return None
    return tokens_per_s * flops_per_token(shape) / peak_flops


def gpu_peak_flops(device: torch.device) -> tuple[float | None, str]:
    """(dense bf16 FLOP/s, where from) of this GPU from hpctrain's peak table; (None, why) elsewhere."""
    if device.type != "cuda":
        return None, "MFU n/a on a CPU (no datasheet peak)"
    from hpctrain.telemetry.accelerators import peak_tflops
    from hpctrain.telemetry.flops import accelerator_key

    name = torch.cuda.get_device_name(device)
    key = accelerator_key(name)
    if key is None:
        return None, f"MFU n/a: {name} is not in hpctrain.telemetry.accelerators's peak table"
    return peak_tflops(key, "bf16") * 1e12, f"{name}: dense bf16 peak {peak_tflops(key, 'bf16'):g} TFLOP/s (datasheet)"


# ---------------------------------------------------------------- the runs


def hpctrain_overrides(p: Preset, spec: Path, precision: str) -> list[str]:
    s = p.shape
    return ["model.name=llama", f"model.n_layers={s.n_layers}", f"model.hidden={s.hidden}", f"model.heads={s.heads}",
            f"model.kv_heads={s.kv}", f"model.ffn_hidden={s.ffn}", f"model.vocab={s.vocab}",
            f"model.seq_len={s.seq_len}",
            f"model.tie_weights={str(s.tie_weights).lower()}", "data.name=bench.mfu_data:windows",
            f"data.path={spec}", f"data.batch_size={p.batch}", "data.shuffle=none", f"precision={precision}",
            f"train.compile={str(p.compile).lower()}", "optim.name=adamw", f"optim.lr={p.lr}", "optim.betas=[0.9,0.95]",
            "optim.weight_decay=0.1", "train.clip_grad_norm=1.0"]


def run_hpctrain(ctx: Context, p: Preset, spec: Path, precision: str) -> dict[str, Any]:
    from hpctrain.telemetry.runs import load_run

    if precision == "fp8":
        try:  # the check precision=fp8 makes in `hpctrain train`, with its message, before a process starts
            check_fp8(ctx.device)
        except UserError as err:
            return skipped("hpctrain", precision, str(err))
    name = f"hpctrain-{precision}"
    stats = hpctrain_run(ctx.work, name, hpctrain_overrides(p, spec, precision), p.steps)
    losses = [(int(r["step"]), float(r["loss"])) for r in load_run(ctx.work / name).train if "loss" in r]
    return row("hpctrain", precision, stats.samples_per_s * p.shape.seq_len, stats.peak_mem_gb, stats.mem_kind, losses)


def titan_reason(ctx: Context) -> str | None:
    """Why torchtitan cannot run here (before a process is started), or None."""
    if importlib.util.find_spec("torchtitan") is None:
        return "torchtitan is not installed; hint: pip install 'hpctrain[mfu]' (torchtitan, keeping your torch)"
    if not ctx.gpu:
        return ("torchtitan's Trainer needs a GPU (its device helpers fall back to torch.cuda without one, and its "
                "model package imports triton, which CPU builds of torch lack)")
    return None


def run_titan(ctx: Context, p: Preset, spec: Path) -> dict[str, Any]:
    reason = titan_reason(ctx)
    if reason is not None:
        return skipped("torchtitan", "bf16", reason)
    from bench.mfu_titan import TitanSettings

    s = p.shape
    settings = TitanSettings(spec=str(spec), layers=s.n_layers, hidden=s.hidden, heads=s.heads, kv_heads=s.kv,
                             ffn_hidden=s.ffn, tie_weights=s.tie_weights, batch=p.batch, warmup=p.steps.warmup,
                             measured=p.steps.measured, lr=p.lr, compile=p.compile)
    path, prefix = ctx.work / "torchtitan.settings.json", ctx.work / "torchtitan.report"
    path.write_text(json.dumps(asdict(settings)) + "\n")
    launch(command(1, "bench.mfu_titan", [str(prefix), str(path)], torchrun=True), ctx.work / "torchtitan.log")
    rank0 = next(r for r in rank_reports(prefix) if r["rank"] == 0)
    losses = [(int(step), float(loss)) for step, loss in rank0["losses"]]
    return row("torchtitan", "bf16", rank0["tokens_per_s"], rank0["peak_mem_gb"], rank0["mem_kind"], losses)


def row(trainer: str, precision: str, tokens_per_s: float, peak_gb: float, mem_kind: str,
        losses: list[tuple[int, float]]) -> dict[str, Any]:
    return {"trainer": trainer, "precision": precision, "status": "ran", "tokens_per_s": tokens_per_s,
            "peak_mem_gb": peak_gb, "mem_kind": mem_kind, "loss": losses[-1][1] if losses else None,
            "losses": losses}


def skipped(trainer: str, precision: str, reason: str) -> dict[str, Any]:
    return {"trainer": trainer, "precision": precision, "status": "skipped", "reason": reason, "tokens_per_s": None,
            "peak_mem_gb": None, "loss": None, "losses": []}


# ---------------------------------------------------------------- the case


def run(ctx: Context) -> BenchResult:
    p = preset(ctx)
    samples = p.batch * p.steps.total
    spec = write_spec(ctx.work / "windows.json", WindowSpec(p.shape.vocab, p.shape.seq_len, samples))
    peak, peak_source = gpu_peak_flops(ctx.device)
    plan = [("hpctrain", "bf16"), ("torchtitan", "bf16"), ("hpctrain", "fp8")]
    rows = []
    for trainer, precision in progress(plan, "mfu"):
        rows.append(run_titan(ctx, p, spec) if trainer == "torchtitan" else run_hpctrain(ctx, p, spec, precision))
    base = rows[0]
    for r in rows:
        ran = r["tokens_per_s"] is not None
        r["mfu"] = mfu(r["tokens_per_s"], p.shape, peak) if ran else None
        r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"] if ran and base["tokens_per_s"] else None
    s = p.shape
    return BenchResult(
        title=(f"mfu: llama {p.name} ({s.params:,} params), seq {s.seq_len}, batch {p.batch}, "
               f"compile {'on' if p.compile else 'off'}, on {ctx.device.type}"),
        columns=[("trainer", "trainer"), ("precision", "precision"), ("tokens_per_s", "tokens/s"),
                 ("speedup", "x hpctrain bf16"), ("mfu", "MFU"), ("peak_mem_gb", "peak GB"), ("loss", "last loss"),
                 ("status", "status")],
        rows=rows, plot=plot,
        settings={"preset": p.name, "params": s.params, "shape": asdict(s), "batch": p.batch,
                  "warmup_steps": p.steps.warmup, "measured_steps": p.steps.measured, "compile": p.compile,
                  "lr": p.lr, "flops_per_token": flops_per_token(s), "peak_flops": peak, "peak_source": peak_source,
                  "fp8_loss_tolerance": FP8_LOSS_TOLERANCE},
        summary=summary(rows, s, ctx.gpu),
        notes=notes(rows, peak_source, ctx),
    )


def summary(rows: list[dict[str, Any]], shape: LlamaShape, gpu: bool) -> dict[str, Any]:
    hp, titan, fp8 = rows
    out: dict[str, Any] = {"hpctrain_mfu": hp["mfu"], "torchtitan_mfu": titan["mfu"]}
    out["hpctrain_vs_torchtitan"] = (hp["tokens_per_s"] / titan["tokens_per_s"]
                                     if hp["tokens_per_s"] and titan["tokens_per_s"] else None)
    out["fp8_speedup"] = fp8["speedup"]
    out["fp8_loss_rel_diff"] = loss_rel_diff(hp["losses"], fp8["losses"])
    out["fp8_loss_parity"] = (None if out["fp8_loss_rel_diff"] is None
                              else out["fp8_loss_rel_diff"] <= FP8_LOSS_TOLERANCE)
    if gpu:  # the goals, judged only where they mean something
        ratio = out["hpctrain_vs_torchtitan"]
        out["goal_within_3pct_of_torchtitan"] = None if ratio is None else ratio >= GOAL_RATIO
        out["goal_mfu_45pct_at_1b"] = (None if hp["mfu"] is None or shape.params < 1e9
                                       else hp["mfu"] >= GOAL_MFU)
    return out


def loss_rel_diff(reference: list[tuple[int, float]], other: list[tuple[int, float]]) -> float | None:
    """|mean(other) - mean(reference)| / mean(reference) over the logged steps both have; None if none."""
    ref, oth = dict(reference), dict(other)
    steps = sorted(set(ref) & set(oth))
    if not steps:
        return None
    mean_ref = sum(ref[s] for s in steps) / len(steps)
    mean_oth = sum(oth[s] for s in steps) / len(steps)
    return abs(mean_oth - mean_ref) / mean_ref


def notes(rows: list[dict[str, Any]], peak_source: str, ctx: Context) -> list[str]:
    out = [peak_source]
    if not ctx.gpu:
        out.append("a CPU run checks the plumbing only: its figures are not a performance result")
    out += [f"{r['trainer']} {r['precision']} skipped: {r['reason']}" for r in rows if r["status"] == "skipped"]
    return out


def plot(fig: Any, result: BenchResult) -> None:
    rate_ax, mem_ax = fig.subplots(1, 2)
    ran = [r for r in result.rows if r["tokens_per_s"] is not None]
    names = [f"{r['trainer']}\n{r['precision']}" for r in ran]
    rate_ax.bar_label(rate_ax.bar(names, [r["tokens_per_s"] for r in ran]), fmt=fmt)
    rate_ax.set(title="throughput", ylabel="tokens / s")
    mem_ax.bar_label(mem_ax.bar(names, [r["peak_mem_gb"] for r in ran], color="#ff7f0e"), fmt="%.2f")
    mem_ax.set(title="peak memory", ylabel="GB")
    for ax in (rate_ax, mem_ax):
        ax.grid(axis="y", alpha=0.3)


__all__ = ["CPU", "FP8_LOSS_TOLERANCE", "GPU", "QUICK", "Preset", "flops_per_token", "gpu_peak_flops",
           "loss_rel_diff", "mfu", "run"]
