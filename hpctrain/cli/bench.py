"""``hpctrain bench NAME [--quick] [--out DIR] [--from DIR]``: run one case, print its table, write
JSON and PNG.

The cases are workshop demos, not part of the installed package: they live in a source
checkout's ``benchmarks/bench/`` (beside the other benchmark scripts) and are found there,
next to an editable install, or where ``--from`` / ``HPCTRAIN_BENCH_DIR`` point.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path
from typing import Any

from hpctrain.core.errors import UserError

BENCH_DIR_ENV = "HPCTRAIN_BENCH_DIR"
# An editable install (pip install -e .) runs this file from the checkout: its benchmarks/ is here.
_BESIDE_PACKAGE = Path(__file__).resolve().parents[2] / "benchmarks"

# name -> what it measures; each name is a module of benchmarks/bench/ with run(Context) -> BenchResult
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
    "long-context": ("a Llama at a sequence one rank's memory budget cannot hold, at parallel.cp 1, 2, 4: memory per "
                     "rank (measured and estimated) and tokens/s"),
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
    p.add_argument("--from", dest="bench_dir", metavar="DIR",
                   help=f"a source checkout (or its benchmarks/ folder) holding the cases (default: ${BENCH_DIR_ENV}, "
                        "else the checkout of an editable install)")
    p.set_defaults(func=cmd_bench)


def find_bench_dir(given: str | None = None) -> Path:
    """The folder holding the ``bench`` package: ``given`` (``--from``), else ``$HPCTRAIN_BENCH_DIR``,
    else the checkout this hpctrain runs from. Each may name the checkout or its ``benchmarks/``."""
    named = given or os.environ.get(BENCH_DIR_ENV)
    for folder in ([Path(named)] if named else [_BESIDE_PACKAGE]):
        for candidate in (folder, folder / "benchmarks"):
            if (candidate / "bench" / "__init__.py").is_file():
                return candidate.resolve()
    where = f"{named} holds no bench/ package" if named else "this hpctrain is installed without its source checkout"
    raise UserError(f"hpctrain bench needs a source checkout ({where}); hint: git clone the repository and "
                    f"pip install -e . there, or pass --from CHECKOUT (or set {BENCH_DIR_ENV}=CHECKOUT)")


def cmd_bench(args: argparse.Namespace) -> int:
    for flag in ("procs", "repeats"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UserError(f"--{flag} {value}: must be 1 or more")
    bench_dir = find_bench_dir(args.bench_dir)
    if str(bench_dir) not in sys.path:  # the runs' processes get it on PYTHONPATH from bench.runner
        sys.path.insert(0, str(bench_dir))
    driver = importlib.import_module("bench.driver")  # by name: the checkout's code, not this package's
    return int(driver.run_case(args.name, Path(args.out), quick=args.quick, procs=args.procs, repeats=args.repeats,
                               command=_command(args)))


def _command(args: argparse.Namespace) -> str:
    parts = ["hpctrain", "bench", args.name, *(["--quick"] if args.quick else []), "--out", str(args.out)]
    parts += [f"--{flag} {getattr(args, flag)}" for flag in ("procs", "repeats") if getattr(args, flag) is not None]
    return " ".join(parts)
