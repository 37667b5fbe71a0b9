"""``hpctrain bench NAME [--quick] [--out DIR]``: run one case, print its table, write JSON and PNG."""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import time
from pathlib import Path
from typing import Any

from hpctrain.bench.context import Context
from hpctrain.bench.hardware import describe, one_line
from hpctrain.bench.output import check_matplotlib, fmt, table, write_json, write_png
from hpctrain.core.errors import UserError

# name -> what it measures; each name is a module of this package with run(Context) -> BenchResult
CASES = {
    "baseline": "simple_cnn samples/s in one process: hpctrain's loop and a plain PyTorch loop",
    "scaling": "1..N processes: speed-up and efficiency of hpctrain and of a plain torch DDP loop, same run",
    "amp": "fp32 vs bf16 (and fp16 on a GPU) on resnet18: samples/s and peak memory",
    "workers": "data.num_workers 0/1/2/4/8 reading tar shards: samples/s and data-wait share",
    "batch": "batch size vs samples/s and peak memory",
    "checkpoint": "checkpoint save/load bandwidth against dd, torch.save and torch.distributed.checkpoint",
    "strategies": ("ddp, zero1, fsdp ZeRO-2/3, fsdp with CPU offload, deepspeed 1-3, tp2, pp2 on a GPT: tokens/s and "
                   "per-rank memory (params/grads/optimizer/activations)"),
    "mfu": ("a Llama through hpctrain and through torchtitan, then fp8 against bf16: tokens/s, MFU, peak memory, "
            "fp8 loss parity"),
}


def add_parser(sub: Any) -> None:
    listing = "; ".join(f"{name}: {text}" for name, text in CASES.items())
    p = sub.add_parser("bench", help="the workshop's benchmarks, one command each: table, JSON and PNG",
                       description=f"Cases: {listing}.")
    p.add_argument("name", choices=list(CASES), metavar="NAME", help=f"one of: {', '.join(CASES)}")
    p.add_argument("--quick", action="store_true", help="a reduced size that runs in seconds (CI)")
    p.add_argument("--out", default="bench-out", help="directory for NAME.json and NAME.png (default: bench-out)")
    p.add_argument("--procs", type=int,
                   help="scaling, strategies: the most processes (default: the GPUs, else the CPU cores)")
    p.add_argument("--repeats", type=int, help="runs per point, in alternating order (default: per case)")
    p.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    for flag in ("procs", "repeats"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UserError(f"--{flag} {value}: must be 1 or more")
    check_matplotlib()
    case = importlib.import_module(f"hpctrain.bench.{args.name}")
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"hpctrain bench: cannot create --out {out}: {err}") from None
    hardware = describe()
    print(f"hpctrain bench {args.name} on {one_line(hardware)}", flush=True)
    work = out / f"{args.name}-work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    start = time.perf_counter()
    try:
        result = case.run(Context(quick=args.quick, work=work, procs=args.procs, repeats=args.repeats))
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
    json_path, png_path = out / f"{args.name}.json", out / f"{args.name}.png"
    write_json(json_path, args.name, result, hardware, _command(args), seconds)
    write_png(png_path, result, hardware)
    print(f"\nwrote {json_path} and {png_path} ({seconds:.0f} s)")
    return 0


def _command(args: argparse.Namespace) -> str:
    parts = ["hpctrain", "bench", args.name, *(["--quick"] if args.quick else []), "--out", str(args.out)]
    parts += [f"--{flag} {getattr(args, flag)}" for flag in ("procs", "repeats") if getattr(args, flag) is not None]
    return " ".join(parts)
