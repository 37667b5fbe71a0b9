"""A case's result and how it leaves: a printed table, ``NAME.json`` and ``NAME.png``.

The JSON holds every row with its raw figures, the summary, the settings, the command and
the hardware; the PNG is drawn by the case with matplotlib's object API (Agg, no pyplot
state) and titled with the hardware, so a figure pasted anywhere still says where it ran.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from tqdm import tqdm

from bench.hardware import one_line
from hpctrain.core.errors import UserError

T = TypeVar("T")


@dataclass
class BenchResult:
    """``columns``: (row key, header) in table order; ``plot(figure, result)`` draws the PNG."""

    title: str
    columns: list[tuple[str, str]]
    rows: list[dict[str, Any]]
    plot: Callable[[Any, BenchResult], None]
    settings: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)  # in the JSON only: every raw figure


def progress(items: Sequence[T], desc: str) -> Iterator[T]:
    """A bar over a case's runs (stderr, so the table on stdout stays clean)."""
    yield from tqdm(items, desc=desc, unit="run", file=sys.stderr, dynamic_ncols=True, leave=False)


def fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"
    if isinstance(value, list):
        return " ".join(fmt(v) for v in value)
    return str(value)


def table(result: BenchResult) -> str:
    header = [h for _, h in result.columns]
    body = [[fmt(row.get(key)) for key, _ in result.columns] for row in result.rows]
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in [header, *body]]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def write_json(path: Path, case: str, result: BenchResult, hardware: dict[str, Any], command: str,
               seconds: float) -> None:
    doc = {"case": case, "title": result.title, "command": command, "hardware": hardware,
           "settings": result.settings, "columns": [k for k, _ in result.columns], "rows": result.rows,
           "summary": result.summary, "notes": result.notes, "details": result.details, "seconds": seconds}
    path.write_text(json.dumps(doc, indent=1) + "\n")


def write_png(path: Path, result: BenchResult, hardware: dict[str, Any]) -> None:
    check_matplotlib()
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9.0, 4.4), layout="constrained")
    result.plot(fig, result)
    fig.suptitle(f"{result.title}\n{one_line(hardware)}", fontsize="small")
    fig.savefig(path, dpi=100)


def check_matplotlib() -> None:
    """Before a long run, not after it: the PNG is part of every case's output."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as err:
        raise UserError(f"hpctrain bench draws its plots with matplotlib ({err}); "
                        "hint: pip install 'hpctrain[bench]'") from None
