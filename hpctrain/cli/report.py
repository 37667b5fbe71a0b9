"""``hpctrain report RUN_DIR [RUN_DIR...] [--html] [--out DIR]``: tables and plots of runs.

Writes into ``--out`` (default: ``RUN_DIR/report`` for one run, ``./report`` for several)
the PNG figures, ``report.md`` (the tables, linking the figures) and with ``--html`` one
self-contained ``report.html`` (figures inlined as base64), and prints the summary table.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from hpctrain.telemetry.report import summary_table, table_text, write_report
from hpctrain.telemetry.runs import load_run


def add_parser(sub: Any) -> None:
    p = sub.add_parser("report", help="summary table and plots of one or more runs (--html: one page)")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (metrics.jsonl, summary.json)")
    p.add_argument("--out", help="output directory (default: RUN_DIR/report, or ./report for several runs)")
    p.add_argument("--html", action="store_true", help="also write report.html with the figures inlined")
    p.set_defaults(func=cmd_report)


def cmd_report(args: argparse.Namespace) -> int:
    runs = [load_run(Path(p)) for p in args.run_dirs]
    out = Path(args.out) if args.out else (runs[0].path / "report" if len(runs) == 1 else Path("report"))
    written = write_report(runs, out, html_page=args.html)
    print(table_text(summary_table(runs)))
    print(f"\nwrote {len(written)} files to {out}: " + ", ".join(p.name for p in written))
    return 0
