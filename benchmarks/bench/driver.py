"""What ``hpctrain bench NAME`` runs once it has found this folder: one case, its table printed,
``NAME.json`` and ``NAME.png`` written (hpctrain/cli/bench.py parses the command line)."""

from __future__ import annotations

import importlib
import os
import shutil
import time
from pathlib import Path

from bench.context import Context
from bench.hardware import describe, one_line
from bench.output import check_matplotlib, fmt, table, write_json, write_png
from hpctrain.core.errors import UserError


def run_case(name: str, out: Path, *, quick: bool, procs: int | None, repeats: int | None, command: str) -> int:
    check_matplotlib()
    case = importlib.import_module(f"bench.{name.replace('-', '_')}")  # long-context: bench/long_context.py
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"hpctrain bench: cannot create --out {out}: {err}") from None
    hardware = describe()
    print(f"hpctrain bench {name} on {one_line(hardware)}", flush=True)
    work = out / f"{name}-work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    start = time.perf_counter()
    try:
        result = case.run(Context(quick=quick, work=work, procs=procs, repeats=repeats))
    except UserError:  # refused before measuring (e.g. a strategy this hpctrain lacks): nothing to keep
        shutil.rmtree(work, ignore_errors=True)
        raise
    shutil.rmtree(work, ignore_errors=True)  # kept after a failed run: the runs' logs are the evidence
    seconds = time.perf_counter() - start
    hardware["load_avg_1m_end"] = os.getloadavg()[0]
    print(f"\n{result.title}\n\n{table(result)}\n")
    for key, value in result.summary.items():
        print(f"{key}: {fmt(value)}")
    for note in result.notes:
        print(f"note: {note}")
    json_path, png_path = out / f"{name}.json", out / f"{name}.png"
    write_json(json_path, name, result, hardware, command, seconds)
    write_png(png_path, result, hardware)
    print(f"\nwrote {json_path} and {png_path} ({seconds:.0f} s)")
    return 0
