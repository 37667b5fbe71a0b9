"""``hpctrain bench checkpoint``: checkpoint save and load bandwidth against dd.

The measuring code of ``benchmarks/checkpoint.py`` (:mod:`bench.ckpt_io`), in the
``--out`` directory's file system: durable writes (dd ``oflag=direct conv=fsync``,
``torch.save`` + fsync, ``torch.distributed.checkpoint``, hpctrain's writer) and cold-cache
reads into the live model (dd ``iflag=direct``, ``torch.load``, DCP, hpctrain's one-pass
verify + load, and the two-pass way), round by round; hpctrain with the default checksum
(checkpoint.hash, xxh3) and with sha256 side by side; plus the async save's stall and a
resume end to end. 1 GB of state by default (a few MB with ``--quick``).
"""

from __future__ import annotations

import warnings
from typing import Any

from bench.ckpt_io import run as measure
from bench.context import Context
from bench.output import BenchResult, progress

# "hpctrain" rows use the default checkpoint.hash (the title names it), the "sha256" rows checkpoint.hash=sha256
WRITES = (("torch.save + fsync", "torch_save"), ("torch.distributed.checkpoint", "dcp_save"),
          ("hpctrain", "hpctrain_save"), ("hpctrain, sha256", "hpctrain_save_sha256"))
READS = (("torch.load + load_state_dict", "torch_load"), ("torch.distributed.checkpoint", "dcp_load"),
         ("hpctrain verify + load, one pass", "hpctrain_load"),
         ("hpctrain verify + load, one pass, sha256", "hpctrain_load_sha256"),
         ("hpctrain verify, then load", "two_pass_load"))


def run(ctx: Context) -> BenchResult:
    gb, width = (0.004, 256) if ctx.quick else (1.0, 4096)
    repeats = ctx.repeats or (1 if ctx.quick else 3)
    step_s = 0.002 if ctx.quick else 0.1
    scratch = ctx.work / "checkpoint"
    scratch.mkdir()
    figures: dict[str, Any] = {}
    for _ in progress(["rounds"], "checkpoint"):  # one call measures every round, interleaved
        with warnings.catch_warnings():  # DCP says on every call that it runs without a process group
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            figures = measure(scratch, gb, repeats, step_s, width)
    rows = rows_of(figures)
    return BenchResult(
        title=f"checkpoint: {figures['state_bytes'] / 1e9:.3g} GB state, {repeats} round(s), bandwidth vs dd, "
              f"checksum {figures['hash']} (and sha256)",
        columns=[("operation", "op"), ("method", "method"), ("GBps", "GB/s"), ("vs_dd", "x dd")],
        rows=rows, plot=plot,
        settings={"state_gb": figures["state_bytes"] / 1e9, "layer_width": width, "repeats": repeats,
                  "async_step_ms": step_s * 1e3, "directory": str(ctx.work.parent)},
        summary={"hpctrain_save_vs_dd": figures["hpctrain_save_vs_dd"],
                 "hpctrain_load_vs_dd": figures["hpctrain_load_vs_dd"],
                 "hpctrain_save_vs_best_peer": figures["hpctrain_save_vs_best_peer"],
                 "hpctrain_load_vs_best_peer": figures["hpctrain_load_vs_best_peer"],
                 "async_stall_ratio": figures["async_stall_ratio"], "resume_s": figures["resume_s"]},
        details=figures,
        notes=["writes are durable (fsync) before the clock stops; reads start from a cold page cache",
               "vs_best_peer = the faster of torch and DCP in the same round / hpctrain (> 1: hpctrain is faster); "
               "median of the rounds",
               "async_stall_ratio = time the loop blocks per async save / a sync save"],
    )


def rows_of(figures: dict[str, Any]) -> list[dict[str, Any]]:
    nbytes = figures["state_bytes"]
    rows = [{"operation": "write", "method": "dd oflag=direct", "GBps": figures["dd_write_GBps"], "vs_dd": 1.0}]
    rows += [{"operation": "write", "method": name, "GBps": nbytes / figures[f"{key}_s"] / 1e9,
              "vs_dd": figures[f"{key}_vs_dd"]} for name, key in WRITES]
    rows.append({"operation": "read", "method": "dd iflag=direct", "GBps": figures["dd_read_GBps"], "vs_dd": 1.0})
    rows += [{"operation": "read", "method": name, "GBps": nbytes / figures[f"{key}_s"] / 1e9,
              "vs_dd": figures[f"{key}_vs_dd"]} for name, key in READS]
    return rows


def plot(fig: Any, result: BenchResult) -> None:
    axes = fig.subplots(1, 2)
    for ax, op in zip(axes, ("write", "read")):
        rows = [r for r in result.rows if r["operation"] == op]
        colors = ["#999999" if r["method"].startswith("dd") else
                  "#1f77b4" if r["method"].startswith("hpctrain") else "#ff7f0e" for r in rows]
        bars = ax.barh([r["method"] for r in rows][::-1], [r["GBps"] for r in rows][::-1], color=colors[::-1])
        ax.bar_label(bars, labels=[f"{r['vs_dd']:.2f}x dd" for r in rows][::-1], fontsize="small")
        ax.set(title=f"{op} (GB/s)", xlabel="GB/s")
        ax.margins(x=0.3)  # room for the labels
        ax.tick_params(axis="y", labelsize="small")
        ax.grid(axis="x", alpha=0.3)
