"""Tables and plots of runs (``hpctrain report``, whose command is :mod:`hpctrain.cli.report`).

:func:`write_report` writes into a folder the PNG figures (plots.py), ``report.md`` (the
tables, linking the figures) and optionally one self-contained ``report.html`` (figures
inlined as base64); :func:`summary_table` is the table the command prints.
"""

from __future__ import annotations

import base64
import html
from collections import defaultdict
from pathlib import Path
from typing import Any

from hpctrain.core.errors import UserError
from hpctrain.telemetry.runs import Run, unique_names

Table = tuple[list[str], list[list[str]]]

SUMMARY_COLUMNS = ("steps", "world_size", "val_loss", "val_accuracy", "samples_per_s", "tokens_per_s", "mfu",
                   "data_wait_share", "train_seconds", "precision", "model")


def write_report(runs: list[Run], out: Path, html_page: bool = False) -> list[Path]:
    try:
        from hpctrain.telemetry.plots import plot_all  # matplotlib, an optional dependency (the report extra)
    except ImportError as err:
        raise UserError(f"hpctrain report needs matplotlib ({err}); hint: pip install 'hpctrain[report]'") from None
    unique_names(runs)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"hpctrain report: cannot create --out {out}: {err}") from None
    pngs = plot_all(runs, out)
    tables = [("Runs", summary_table(runs)), ("Ranks (straggler scores)", rank_table(runs))]
    tables = [(title, t) for title, t in tables if t[1]]
    md = out / "report.md"
    md.write_text(_markdown(tables, pngs))
    written = [*pngs, md]
    if html_page:
        page = out / "report.html"
        page.write_text(_html(runs, tables, pngs))
        written.append(page)
    return written


# ---------------------------------------------------------------- tables


def _fmt(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _mean(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [float(r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    return sum(values) / len(values) if values else None


def _run_values(run: Run) -> dict[str, Any]:
    """summary.json first; a run that never finished falls back to its metrics rows."""
    values = {k: run.summary.get(k) for k in SUMMARY_COLUMNS}
    last_val = run.val[-1] if run.val else {}
    for key in ("val_loss", "val_accuracy"):
        values[key] = values[key] if values[key] is not None else last_val.get(key)
    for key in ("samples_per_s", "tokens_per_s", "mfu", "data_wait_share"):
        values[key] = values[key] if values[key] is not None else _mean(run.train, key)
    if values["steps"] is None and run.train:
        values["steps"] = run.train[-1].get("step")
    return values


def summary_table(runs: list[Run]) -> Table:
    values = [_run_values(r) for r in runs]
    columns = [c for c in SUMMARY_COLUMNS if any(v[c] is not None for v in values)]
    return ["run", *columns], [[r.name, *(_fmt(v[c]) for c in columns)] for r, v in zip(runs, values)]


def rank_table(runs: list[Run]) -> Table:
    """Per run and rank: node, mean own work, mean relative score, worst individual score,
    and how often the rank was named a straggler."""
    rows = []
    for run in runs:
        per_rank: dict[int, list[dict[str, Any]]] = defaultdict(list)
        named: dict[int, int] = defaultdict(int)
        for row in run.stragglers:
            for r in row["ranks"]:
                per_rank[r["rank"]].append(r)
            for rank in row.get("stragglers", []):
                named[rank] += 1
        for rank, entries in sorted(per_rank.items()):
            rows.append([run.name, str(rank), entries[-1]["node"], _fmt(_mean(entries, "work_s")),
                         _fmt(_mean(entries, "relative")), _fmt(min(e["individual"] for e in entries)),
                         f"{named[rank]}/{len(run.stragglers)}"])
    return ["run", "rank", "node", "work s/step", "relative", "worst individual", "named straggler"], rows


def table_text(table: Table) -> str:
    header, rows = table
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(header)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths)) for line in [header, *rows]]
    return "\n".join(lines)


def _markdown(tables: list[tuple[str, Table]], pngs: list[Path]) -> str:
    parts = ["# hpctrain report\n"]
    for title, (header, rows) in tables:
        parts += [f"## {title}\n", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        parts += ["| " + " | ".join(r) + " |" for r in rows]
        parts.append("")
    parts += [f"![{p.stem}]({p.name})\n" for p in pngs]
    return "\n".join(parts)


def _html(runs: list[Run], tables: list[tuple[str, Table]], pngs: list[Path]) -> str:
    body = [f"<h1>hpctrain report: {html.escape(', '.join(r.name for r in runs))}</h1>"]
    for title, (header, rows) in tables:
        body.append(f"<h2>{html.escape(title)}</h2><table><tr>"
                    + "".join(f"<th>{html.escape(c)}</th>" for c in header) + "</tr>")
        body += ["<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows]
        body.append("</table>")
    for png in pngs:
        data = base64.b64encode(png.read_bytes()).decode()
        body.append(f'<h2>{html.escape(png.stem)}</h2><img alt="{html.escape(png.stem)}" '
                    f'src="data:image/png;base64,{data}">')
    style = ("body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
             "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}img{max-width:100%}")
    return (f"<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>hpctrain report</title>"
            f"<style>{style}</style></head><body>{''.join(body)}</body></html>\n")
