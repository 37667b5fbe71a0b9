"""What the GPT training tests read back from a run: its exit, its per-step losses, its
summary; and one comparison of losses (every step present, each within a tolerance)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

TOL = 1e-5


def check_ok(proc: subprocess.CompletedProcess[str]) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stderr[-4000:]}"


def step_losses(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows if "loss" in row}


def assert_close(got: dict[int, float], want: dict[int, float], tol: float = TOL) -> None:
    assert got.keys() == want.keys()
    worst = max(abs(got[s] - want[s]) for s in want)
    assert worst < tol, (worst, got, want)


def read_summary(run: Path) -> dict[str, Any]:
    return json.loads((run / "summary.json").read_text())
