"""Read a finished (or crashed) run directory: metrics.jsonl rows by kind, and summary.json.

Row kinds in metrics.jsonl: ``kind: straggler`` rows (see stragglers.py), validation rows
(keys ``val_*``), and training rows (everything else with a ``step``). Column names the
report understands beyond today's (``loss``, ``lr``, ``samples_per_s``, ``data_wait_share``):
``tokens_per_s``, ``mfu``, the step-time breakdown :data:`BREAKDOWN` (seconds per step in
the interval) and the memory columns :data:`MEMORY` (GB).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpctrain.core.errors import UserError

log = logging.getLogger("hpctrain")

BREAKDOWN = ("time_data_s", "time_fwd_bwd_s", "time_optim_s", "time_ckpt_s", "time_eval_s", "time_other_s")
MEMORY = ("mem_peak_gb", "mem_rss_gb")


@dataclass
class Run:
    name: str
    path: Path
    summary: dict[str, Any] = field(default_factory=dict)
    train: list[dict[str, Any]] = field(default_factory=list)
    val: list[dict[str, Any]] = field(default_factory=list)
    stragglers: list[dict[str, Any]] = field(default_factory=list)


def load_run(path: Path) -> Run:
    """A run directory's rows and summary; a UserError if it holds neither."""
    metrics, summary = path / "metrics.jsonl", path / "summary.json"
    if not path.is_dir():
        raise UserError(f"hpctrain report: {path} is not a directory; hint: pass a run.dir, e.g. runs/mnist-mnist_cnn")
    if not metrics.exists() and not summary.exists():
        raise UserError(f"hpctrain report: {path} holds neither metrics.jsonl nor summary.json; is it a run.dir?")
    run = Run(name=path.resolve().name, path=path)
    if summary.exists():
        try:
            run.summary = json.loads(summary.read_text())
        except ValueError as err:
            raise UserError(f"hpctrain report: {summary} is not valid JSON ({err})") from None
    for row in _rows(metrics):
        if row.get("kind") == "straggler":
            run.stragglers.append(row)
        elif any(k.startswith("val_") for k in row):
            run.val.append(row)
        elif "step" in row:
            run.train.append(row)
    return run


def _rows(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows, bad = [], 0
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            bad += 1  # a crash can cut the last line short
            continue
        if isinstance(row, dict):
            rows.append(row)
    if bad:
        log.warning("%s: skipped %d unreadable line(s)", path, bad)
    return rows


def unique_names(runs: list[Run]) -> None:
    """Two runs called ``run`` in different folders get their parent folder as a prefix."""
    names = [r.name for r in runs]
    for run in runs:
        if names.count(run.name) > 1:
            run.name = f"{run.path.resolve().parent.name}/{run.name}"
