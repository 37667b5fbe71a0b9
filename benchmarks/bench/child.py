"""``python -m bench.child PREFIX key=value ...``: one rank of a benchmark run.

Runs ``hpctrain train`` (the same :func:`hpctrain.train.train` the CLI calls) with the
overrides, then writes ``PREFIX.rankN.json``: this rank's peak memory and the run's summary.
The overrides are read before torch is imported, so a bad one fails the run at once; a run
that worked ends without the interpreter's teardown (:func:`finish`).
"""

from __future__ import annotations

import json
import os
import resource
import sys
from pathlib import Path
from typing import Any, NoReturn


def peak_memory() -> tuple[float, str]:
    """(GB, kind): CUDA's peak allocated bytes on a GPU, else the process's peak RSS."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 1e9, "cuda_max_allocated"
    return peak_rss_bytes() / 1e9, "peak_rss"


def peak_rss_bytes() -> int:
    """VmHWM, the high-water mark of this process image. Not ru_maxrss: after fork + exec
    that starts at the parent's peak (measured: a 1.5 GB parent gives every child 1.5 GB)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # elsewhere: the best there is


def report(prefix: Path, rank: int, extra: dict[str, Any]) -> None:
    gb, kind = peak_memory()
    path = prefix.parent / f"{prefix.name}.rank{rank}.json"
    path.write_text(json.dumps({"rank": rank, "peak_mem_gb": gb, "mem_kind": kind, **extra}, default=str) + "\n")


def main(argv: list[str]) -> int:
    from hpctrain.config import load_config

    cfg = load_config(None, argv[1:])  # imports no torch: a bad override fails in a fraction of a second
    from hpctrain.train import train

    summary = train(cfg)
    report(Path(argv[0]), int(os.environ.get("RANK", "0")), {"summary": summary})
    return 0


def finish(code: int) -> NoReturn:
    """End a benchmark process whose report is written: at once, without the interpreter's
    teardown of torch and its libraries (about a second of CPU per process, measured, which
    torchrun and the bench wait for). What the run wrote is closed already; logging and the
    standard streams are flushed here. With multiprocessing children still running (data
    loader workers) it exits the ordinary way, which stops them."""
    import logging
    import multiprocessing

    if multiprocessing.active_children():
        raise SystemExit(code)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    finish(main(sys.argv[1:]))
