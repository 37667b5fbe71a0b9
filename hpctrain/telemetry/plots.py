"""The PNG figures of ``hpctrain report``: one file per question, every run overlaid.

matplotlib's object API (``Figure``, no pyplot) renders with Agg and keeps no global
state. A figure whose columns no run has is not drawn.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hpctrain.telemetry.runs import BREAKDOWN, MEMORY, Run

Series = list[tuple[int, float]]


def _figure(rows: int = 1, cols: int = 1, width: float = 7.0, height: float = 3.6) -> Any:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height * rows), layout="constrained")
    return fig, fig.subplots(rows, cols, squeeze=False)


def _series(rows: list[dict[str, Any]], key: str) -> Series:
    return [(int(r["step"]), float(r[key])) for r in rows if isinstance(r.get(key), (int, float)) and "step" in r]


def _lines(path: Path, runs: list[Run], keys: list[str], title: str, ylabel: str,
           which: Callable[[Run], list[dict[str, Any]]]) -> Path | None:
    fig, axes = _figure()
    ax, drawn = axes[0][0], False
    for run in runs:
        for key in keys:
            points = _series(which(run), key)
            if points:
                label = key if len(runs) == 1 else f"{run.name}: {key}"
                ax.plot(*zip(*points), marker="o" if len(points) < 30 else None, markersize=3, label=label)
                drawn = True
    if not drawn:
        return None
    ax.set(title=title, xlabel="step", ylabel=ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.savefig(path, dpi=100)
    return path


def plot_all(runs: list[Run], out: Path) -> list[Path]:
    """Every figure the runs have data for, as PNG files in ``out``."""
    val_keys = sorted({k for r in runs for row in r.val for k in row
                       if k.startswith("val_") and k not in ("val_loss", "val_count", "val_correct")})
    made = [
        _lines(out / "loss.png", runs, ["loss"], "training loss", "loss", lambda r: r.train),
        _lines(out / "val_loss.png", runs, ["val_loss"], "validation loss", "loss", lambda r: r.val),
        _lines(out / "validation.png", runs, val_keys, "validation metrics", "value", lambda r: r.val),
        _lines(out / "throughput.png", runs, ["samples_per_s", "tokens_per_s"], "throughput", "per second",
               lambda r: r.train),
        _lines(out / "data_wait.png", runs, ["data_wait_share"], "share of time waiting for data", "share",
               lambda r: r.train),
        _lines(out / "mfu.png", runs, ["mfu"], "model FLOPs utilisation", "MFU", lambda r: r.train),
        _lines(out / "memory.png", runs, list(MEMORY), "peak memory", "GB", lambda r: r.train),
        _breakdown(out / "step_time.png", runs),
        _stragglers(out / "stragglers.png", runs),
    ]
    return [p for p in made if p is not None]


def _breakdown(path: Path, runs: list[Run]) -> Path | None:
    """Stacked seconds per step by phase, one panel per run."""
    having = [r for r in runs if any(k in row for row in r.train for k in BREAKDOWN)]
    if not having:
        return None
    fig, axes = _figure(rows=len(having))
    for ax, run in zip((a[0] for a in axes), having):
        keys = [k for k in BREAKDOWN if any(k in row for row in run.train)]
        rows = [row for row in run.train if "step" in row]
        ax.stackplot([row["step"] for row in rows], *[[float(row.get(k, 0.0)) for row in rows] for k in keys],
                     labels=keys)
        ax.set(title=f"{run.name}: step time by phase", xlabel="step", ylabel="seconds per step")
        ax.legend(fontsize="small", loc="upper left")
    fig.savefig(path, dpi=100)
    return path


def _stragglers(path: Path, runs: list[Run]) -> Path | None:
    """Per rank: own work per step over time, and the mean relative score by rank and by node."""
    having = [r for r in runs if r.stragglers]
    if not having:
        return None
    fig, axes = _figure(rows=len(having), cols=3, width=15.0)
    for (work_ax, rank_ax, node_ax), run in zip(axes, having):
        per_rank: dict[int, Series] = defaultdict(list)
        relative: dict[int, list[float]] = defaultdict(list)
        nodes: dict[str, list[float]] = defaultdict(list)
        for row in run.stragglers:
            for r in row["ranks"]:
                per_rank[r["rank"]].append((row["step"], r["work_s"]))
                relative[r["rank"]].append(r["relative"])
                nodes[r["node"]].append(r["work_s"])
        for rank, points in sorted(per_rank.items()):
            work_ax.plot(*zip(*points), label=f"rank {rank}")
        work_ax.set(title=f"{run.name}: own work per step", xlabel="step", ylabel="seconds")
        work_ax.legend(fontsize="small")
        ranks = sorted(relative)
        rank_ax.bar([str(r) for r in ranks], [sum(relative[r]) / len(relative[r]) for r in ranks])
        rank_ax.set(title="relative score (best rank = 1.0)", xlabel="rank", ylim=(0, 1.05))
        names = sorted(nodes)
        node_ax.bar(names, [sum(nodes[n]) / len(nodes[n]) for n in names])
        node_ax.set(title="mean work per step by node", xlabel="node", ylabel="seconds")
    fig.savefig(path, dpi=100)
    return path
