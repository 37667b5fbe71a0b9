"""Where the warm PNG path spends its time per sample (issue 18, point 5): hpctrain shards decoded
by PIL beside webdataset, litdata and Mosaic streaming reading the same PNG bytes.

    python benchmarks/data_profile.py --samples 5000 --seconds 8 --json profile.json   # ~3 min

Two measurements, both CPU time (not wall time: the machine is shared, and CPU per sample is what
a loader costs whatever the load):

1. **Stages, in one process** (``num_workers=0``, page cache warm). Each reader of
   ``benchmarks/data.py`` reads the data over and over for ``--seconds`` in a child process
   sampled by ``py-spy`` (sampling, not tracing: no per-call overhead inflates the Python-heavy
   parts). Each sampled stack goes to one stage by the frames in it (:func:`stage`); a stage's
   share of the main thread's samples times the main thread's CPU time per sample gives its
   microseconds per sample; the CPU of a reader's own threads is a row of its own.
2. **Worker IPC**: what each reader's DataLoader worker sends per batch of 64, through a
   one-worker DataLoader: the CPU of both processes per batch minus that of building the same
   batch and sending nothing. A torch tensor from a worker is a new shared-memory segment whose
   descriptor is handed over through a socket; a :class:`~hpctrain.data.batch.PackedBatch` is
   numpy arrays pickled into the pipe.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import data as bench  # noqa: E402 - benchmarks/data.py: the same data, readers and peers

from hpctrain.data.batch import Batch, PackedBatch  # noqa: E402
from hpctrain.data.decode import InputConversion  # noqa: E402

PROFILED = ("shards-png-pil", "wds-png", "litdata-png", "mds-png")
STAGES = ("read bytes (index, tar/chunk, checks)", "bytes to PIL (Image.open: header)",
          "PIL decode (ImageFile.load: inflate, unfilter)", "PIL pixels out (tobytes, convert, asarray)",
          "to tensor + collate", "loader Python (sampler, shuffle, dispatch, glue)")
READ_MODULES = ("tarfile.py", "webdataset/tariterators.py", "webdataset/gopen.py", "litdata/streaming/item_loader",
                "litdata/streaming/reader", "litdata/streaming/config", "streaming/base/format",
                "streaming/base/stream", "streaming/base/array")
BACKGROUND = "the reader's background threads"
TENSOR_MODULES = ("torch/", "numpy/", "Decoded.__getitem__ (data.py", "_wds_to_tensor (data.py",
                  "InputConversion.__call__", "PackedBatch.unpack", "ShardDataset._stack")


# ---------------------------------------------------------------- 1. stages, sampled by py-spy


def stage(frames: list[str]) -> str:
    """The stage one sampled stack (outermost frame first) spends its time in."""
    pil = [f for f in frames if "(PIL/" in f]
    if pil:
        if any(f.startswith("ImageFile.load") for f in pil):
            return STAGES[2]
        if any(f.startswith("open (PIL/Image.py") for f in pil):
            return STAGES[1]
        return STAGES[3]
    leaf = frames[-1]
    if leaf.startswith("decode_image (hpctrain/"):  # the bytes handed to PIL, the pixels taken out
        return STAGES[3]
    if any(m in leaf for m in READ_MODULES) or leaf.startswith("ShardDataset.read ("):
        return STAGES[0]
    if any(m in leaf for m in TENSOR_MODULES):
        return STAGES[4]
    return STAGES[5]


def stage_shares(raw: str, marker: str = "_timed_pass (") -> dict[str, float]:
    """py-spy's raw output (``frame;frame;... count`` per line) -> each stage's share of the
    samples taken inside the measured passes (imports and each reader's construction left out,
    as benchmarks/data.py leaves them out of its timing)."""
    counts: Counter[str] = Counter()
    for line in raw.splitlines():
        stack, _, n = line.rpartition(" ")
        frames = stack.split(";")
        if not n.isdigit() or not any(f.startswith(marker) for f in frames):
            continue
        counts[stage(frames)] += int(n)
    total = sum(counts.values()) or 1
    return {s: counts[s] / total for s in STAGES} | {"sampled_stacks": float(sum(counts.values()))}


def _timed_pass(batches: Any) -> tuple[float, float, int]:
    """One pass over a reader's batches: (CPU s of the process, of this thread, samples); the
    frame py-spy's stacks are kept by."""
    process, thread = time.process_time(), time.thread_time()
    _, count = bench.measure(batches)
    return time.process_time() - process, time.thread_time() - thread, count


def _passes(name: str, root: Path, seconds: float) -> dict[str, float]:
    """Read ``root`` with reader ``name`` (0 workers) until ``seconds`` of CPU."""
    _, reader = bench.READERS[name]
    cpu, main_cpu, samples = 0.0, 0.0, 0
    while cpu < seconds:
        took, took_main, count = _timed_pass(reader(root, 0))
        cpu, main_cpu, samples = cpu + took, main_cpu + took_main, samples + count
    return {"cpu_s": cpu, "main_cpu_s": main_cpu, "samples": samples}


def child(name: str, root: Path, seconds: float, out: Path) -> None:
    torch.set_num_threads(1)
    data_dir = root / bench.READERS[name][0]
    bench.warm_cache(data_dir)
    bench.measure(bench.READERS[name][1](data_dir, 0))  # warm-up pass (imports, first opens)
    out.write_text(json.dumps(_passes(name, data_dir, seconds)))


def profile_reader(name: str, root: Path, seconds: float, rate: int) -> dict[str, Any]:
    """One reader in a child process under py-spy: CPU us per sample, in total and per stage."""
    with tempfile.TemporaryDirectory() as tmp:
        raw, out = Path(tmp) / "raw.txt", Path(tmp) / "out.json"
        cmd = ["py-spy", "record", "--nonblocking", "--rate", str(rate), "--format", "raw", "--output", str(raw),
               "--", sys.executable, __file__, "--child", name, "--dir", str(root), "--seconds", str(seconds),
               "--child-out", str(out)]
        subprocess.run(cmd, check=True, capture_output=True)
        result = json.loads(out.read_text())
        shares = stage_shares(raw.read_text())
    per_sample, main = (1e6 * result[k] / result["samples"] for k in ("cpu_s", "main_cpu_s"))
    row = {"reader": name, "cpu_us_per_sample": per_sample, "sampled_stacks": int(shares.pop("sampled_stacks"))}
    # the main thread's CPU split by its sampled stacks; a reader's own threads (litdata's chunk
    # preparer, streaming's) are the rest of the process's CPU
    return row | {"stages_us": {s: shares[s] * main for s in STAGES} | {BACKGROUND: per_sample - main}}


# ---------------------------------------------------------------- 2. worker IPC per batch

BATCH, SHAPE = 64, (32, 32, 3)
PIXELS = np.random.default_rng(0).integers(0, 256, (BATCH, *SHAPE), dtype=np.uint8)
KEYS = [f"s{i:06d}" for i in range(BATCH)]
TO_MODEL = InputConversion(image=True, scale=255.0)


def _floats() -> torch.Tensor:
    return TO_MODEL(PIXELS.copy())


def _samples() -> list[tuple[torch.Tensor, int]]:
    x = _floats()
    return [(x[i].clone(), i % 10) for i in range(BATCH)]


# kind -> (build the batch a worker returns, build the same in private memory and send nothing)
KINDS: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {
    "tensors (hpctrain before; webdataset)": (
        lambda: Batch(_floats(), torch.arange(BATCH), KEYS), lambda: (Batch(_floats(), torch.arange(BATCH), KEYS),)),
    "default_collate into shared memory (litdata, streaming)": (
        lambda: default_collate(_samples()), lambda: (torch.stack([x for x, _ in _samples()]),)),
    "PackedBatch: uint8 numpy + lists (hpctrain now)": (
        lambda: PackedBatch(PIXELS.copy(), list(range(BATCH)), KEYS, None, TO_MODEL),
        lambda: (PackedBatch(PIXELS.copy(), list(range(BATCH)), KEYS, None, TO_MODEL),)),
}


class _Built(Dataset):
    def __init__(self, build: Callable[[], Any], send: bool) -> None:
        self.build, self.send = build, send

    def __len__(self) -> int:
        return 1 << 30

    def __getitems__(self, ids: list[int]) -> Any:
        batch = self.build()
        return batch if self.send else None


class _Batches(Sampler[list[int]]):
    def __init__(self, count: int) -> None:
        self.count = count

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter([list(range(BATCH))] * self.count)

    def __len__(self) -> int:
        return self.count


def _cpu() -> float:
    mine, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return mine.ru_utime + mine.ru_stime + kids.ru_utime + kids.ru_stime


def _cpu_per_batch(build: Callable[[], Any], send: bool, batches: int) -> float:
    """CPU of the main process and its one worker (reaped at the end) per batch, in us."""
    loader = DataLoader(_Built(build, send), batch_sampler=_Batches(batches), collate_fn=lambda b: b,
                        num_workers=1, prefetch_factor=4, persistent_workers=False)
    start = _cpu()
    for _ in loader:
        pass
    del loader
    return 1e6 * (_cpu() - start) / batches


def ipc_costs(batches: int, rounds: int) -> dict[str, float]:
    """us of CPU per sample to move one batch of each kind from a worker (best of ``rounds``)."""
    out = {}
    for kind, (sent, kept) in KINDS.items():
        best = min(_cpu_per_batch(sent, True, batches) - _cpu_per_batch(kept, False, batches) for _ in range(rounds))
        out[kind] = max(0.0, best) / BATCH
    return out


# ---------------------------------------------------------------- report


def table(rows: list[dict[str, Any]], ipc: dict[str, float]) -> str:
    names = {"shards-png-pil": "hpctrain, PIL", "wds-png": "webdataset", "litdata-png": "litdata",
             "mds-png": "streaming (MDS)"}
    head = "| us per sample (CPU) | " + " | ".join(names[r["reader"]] for r in rows) + " |"
    lines = [head, "|---" * (len(rows) + 1) + "|"]
    for s in (*STAGES, BACKGROUND):
        lines.append(f"| {s} | " + " | ".join(f"{max(0.0, r['stages_us'][s]):.0f}" for r in rows) + " |")
    lines.append("| **total, in process** | " + " | ".join(f"**{r['cpu_us_per_sample']:.0f}**" for r in rows) + " |")
    lines.append("")
    lines.append("| worker IPC, one batch of 64 | us per sample (CPU, both processes) |")
    lines.append("|---|---|")
    lines += [f"| {kind} | {us:.1f} |" for kind, us in ipc.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=5000)
    parser.add_argument("--per-shard", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=8.0, help="CPU seconds each reader is sampled for")
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    parser.add_argument("--readers", default=",".join(PROFILED))
    parser.add_argument("--ipc-batches", type=int, default=200)
    parser.add_argument("--ipc-rounds", type=int, default=3)
    parser.add_argument("--dir", help="work directory (default: a temporary one)")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, Path(args.dir), args.seconds, Path(args.child_out))
        return 0
    torch.set_num_threads(1)
    asked = args.readers.split(",")
    skipped = bench.missing_peers(asked)
    for reader, why in skipped.items():
        print(f"skipped {reader}: {why}", flush=True)
    readers = [r for r in asked if r not in skipped]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.dir or tmp)
        if not (root / "shards-png").is_dir():
            bench.build(root, args.samples, args.per_shard, peers=[r for r in bench.OTHERS if r in readers])
        rows = []
        for name in readers:
            rows.append(profile_reader(name, root, args.seconds, args.rate))
            print(f"{name:<15} {rows[-1]['cpu_us_per_sample']:6.0f} us/sample CPU "
                  f"({rows[-1]['sampled_stacks']} stacks), load {os.getloadavg()[0]:.1f}", flush=True)
    ipc = ipc_costs(args.ipc_batches, args.ipc_rounds)
    print(table(rows, ipc))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "ipc_us_per_sample": ipc, "skipped": skipped,
                                               "cpus": os.cpu_count()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
