"""Checkpoint benchmark (issue 4): save / load bandwidth against dd, async stall, resume time.

    python benchmarks/checkpoint.py [--gb 1.0] [--dir /tmp/hpctrain-bench] [--json out.json]

* save: the sync writer (torch.save with sha256 while writing, fsync, manifest, rename)
  against ``dd if=/dev/zero bs=16M oflag=direct conv=fsync`` of the same byte count;
* load: verify (sha256 of every file) + load into the live, pre-touched model, from a cold
  page cache (posix_fadvise DONTNEED), against ``dd iflag=direct`` reading the same bytes;
* async stall: in a loop of (compute standing in for forward + backward, real SGD step),
  the time ``save()`` blocks plus the time the next ``optimizer.step()`` waits for the
  writer thread's copy of parameters and optimizer state, against the sync save time;
  also the extra wall time per save of that loop (informational: it includes the CPU
  and memory bandwidth the background write takes from the loop on this 2-core VM);
* resume: Checkpointer.resume of the newest checkpoint, cold cache.

Buffers are pre-touched and the first save of each mode is a warm-up: this VM first-touches
fresh memory at 1-3 GB/s, which would measure the VM, not the code.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagecache import evict  # noqa: E402 - benchmarks/ is on sys.path when run as a script

from hpctrain.checkpoint import layout  # noqa: E402
from hpctrain.checkpoint.checkpointer import Checkpointer, live_tensors, load_replicated  # noqa: E402
from hpctrain.checkpoint.state import snapshot  # noqa: E402
from hpctrain.checkpoint.writer import CheckpointWriter  # noqa: E402
from hpctrain.config import load_config, to_dict  # noqa: E402
from hpctrain.env import ClusterEnv  # noqa: E402
from hpctrain.precision import Precision  # noqa: E402
from hpctrain.train import Components, Counters  # noqa: E402

CPU = torch.device("cpu")
CFG = to_dict(load_config(None, ["checkpoint.every_seconds=None"]))  # the config saved with the state


class _Loader:
    def state_dict(self) -> dict[str, int]:
        return {"epoch": 0, "batches_done": 0}

    def load_state_dict(self, state: dict[str, int]) -> None:
        pass


def build_parts(gb: float) -> Components:
    """Linear layers of 4096 x 4096 fp32 (64 MiB each) adding up to ``gb`` GB; SGD without
    momentum, so the model is the whole state."""
    layers = max(1, round(gb * 1e9 / (4096 * 4096 * 4)))
    model = nn.Sequential(*[nn.Linear(4096, 4096, bias=False) for _ in range(layers)])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return Components(model, optimizer, None, Precision("fp32", CPU), _Loader(), None, [], Counters())


def state_bytes(parts: Components) -> int:
    return sum(p.numel() * p.element_size() for p in parts.model.parameters())


def dd_write(path: Path, nbytes: int) -> float:
    count = max(1, nbytes // (16 << 20))
    start = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=16M", f"count={count}", "oflag=direct", "conv=fsync"],
                   check=True, capture_output=True)
    return count * (16 << 20) / (time.perf_counter() - start)


def dd_read(path: Path) -> float:
    evict(path)
    start = time.perf_counter()
    subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=16M", "iflag=direct"], check=True, capture_output=True)
    return path.stat().st_size / (time.perf_counter() - start)


def timed_saves(writer: CheckpointWriter, parts: Components, steps: list[int]) -> list[float]:
    times = []
    for step in steps:
        parts.counters.step = step
        start = time.perf_counter()
        writer.save(snapshot(parts, ClusterEnv(), CPU, CFG, {}, "torch"), blocking=True)
        times.append(time.perf_counter() - start)
    return times


def bench_save(root: Path, parts: Components, repeats: int) -> tuple[float, list[float]]:
    writer = CheckpointWriter(root, ClusterEnv(), keep_last=1)
    timed_saves(writer, parts, [1])  # warm-up
    times = timed_saves(writer, parts, list(range(2, 2 + repeats)))
    writer.close()
    return statistics.median(times), times


def bench_async(root: Path, parts: Components, repeats: int, step_s: float) -> tuple[float, float, float]:
    """The loop's stall per async save: the time in ``save()`` plus the time the next
    ``optimizer.step()`` waits for the writer thread's copy of the parameters (the
    Checkpointer's step pre-hook). One loop step = ``step_s`` of compute standing in for
    forward + backward, then a real SGD step over the whole state.
    Returns medians (seconds in save(), seconds in the pre-hook, extra loop time per save)."""
    writer = CheckpointWriter(root, ClusterEnv(), mode="async", keep_last=1)
    waits: list[float] = []

    def before_step(*_: Any) -> None:
        start = time.perf_counter()
        writer.wait_staged()
        waits.append(time.perf_counter() - start)

    hook = parts.optimizer.register_step_pre_hook(before_step)
    for p in parts.model.parameters():
        p.grad = torch.full_like(p, 1e-9)
    x = torch.randn(512, 512)
    reps = max(1, int(step_s / _time_step(lambda: torch.mm(x, x))))

    def loop(steps: int, save_every: int | None, first: int) -> tuple[float, list[float], list[float]]:
        stalls, hook_waits, start = [], [], time.perf_counter()
        for i in range(steps):
            if save_every and i % save_every == 0:
                parts.counters.step = first + i
                t = time.perf_counter()
                writer.save(snapshot(parts, ClusterEnv(), CPU, CFG, {}, "torch"), defer=_mutable(parts))
                stalls.append(time.perf_counter() - t)
            for _ in range(reps):  # forward + backward stand-in
                torch.mm(x, x)
            waits.clear()
            parts.optimizer.step()
            if save_every and i % save_every == 0:
                hook_waits.append(waits[0])
        elapsed = time.perf_counter() - start
        writer.wait()
        return elapsed, stalls, hook_waits

    loop(2, 1, 1)  # warm-up: allocates and touches the staging buffers
    window = 8  # steps between saves: room for each write to finish
    base, _, _ = loop(window * repeats, None, 0)
    with_saves, stalls, hook_waits = loop(window * repeats, window, 1000)
    hook.remove()
    writer.close()
    return statistics.median(stalls), statistics.median(hook_waits), max(0.0, with_saves - base) / repeats


def _mutable(parts: Components) -> set[int]:
    from hpctrain.checkpoint.checkpointer import _updated_by_step

    return _updated_by_step(parts)


def _time_step(fn: Any) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(10):
        fn()
    return (time.perf_counter() - start) / 10


def bench_load(root: Path, parts: Components, repeats: int) -> tuple[float, float, float]:
    """Medians of (verify, load, full Checkpointer.resume) in seconds, each from a cold cache.
    Load = what resume does after verifying: the bytes straight into the live parameters."""
    newest = layout.committed(root)[-1][1]
    verify, load, resume = [], [], []
    cfg = load_config(None, ["checkpoint.every_seconds=None"])
    for _ in range(repeats):
        evict(newest)
        start = time.perf_counter()
        assert layout.verify(newest) == []
        verify.append(time.perf_counter() - start)
        start = time.perf_counter()  # page cache now warm, as in resume after its verify
        state = load_replicated(newest, live_tensors(parts))
        parts.model.load_state_dict(state["model"])
        load.append(time.perf_counter() - start)
        del state
        evict(newest)
        ckpt = Checkpointer(cfg, ClusterEnv(), CPU, root.parent, parts)
        start = time.perf_counter()
        assert ckpt.resume("auto")
        resume.append(time.perf_counter() - start)
        ckpt.close()
    return statistics.median(verify), statistics.median(load), statistics.median(resume)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=1.0, help="state size in GB")
    ap.add_argument("--dir", default="/tmp/hpctrain-bench-ckpt", help="scratch directory (removed at the end)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--step-ms", type=float, default=100.0,
                    help="compute per loop step standing in for forward + backward in the async test")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="torch threads (the trainer's default for one rank: all cores)")
    ap.add_argument("--json", help="write {save_vs_dd, load_vs_dd, async_stall_ratio, ...} here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    scratch = Path(args.dir)
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    try:
        results = run(scratch, args.gb, args.repeats, args.step_ms / 1e3)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    for key, value in results.items():
        print(f"{key:<24} {value:.4g}" if isinstance(value, float) else f"{key:<24} {value}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


def run(scratch: Path, gb: float, repeats: int, step_s: float) -> dict[str, Any]:
    parts = build_parts(gb)
    nbytes = state_bytes(parts)
    dd_file = scratch / "dd.bin"
    dd_w = statistics.median(dd_write(dd_file, nbytes) for _ in range(repeats))
    dd_r = statistics.median(dd_read(dd_file) for _ in range(repeats))
    dd_file.unlink()
    root = scratch / "run" / "checkpoints"
    sync_s, _ = bench_save(root, parts, repeats)
    verify_s, load_s, resume_s = bench_load(root, parts, repeats)
    save_call_s, hook_wait_s, loop_extra_s = bench_async(scratch / "async" / "checkpoints", parts, repeats, step_s)
    stall_s = save_call_s + hook_wait_s
    save_bw, load_bw = nbytes / sync_s, nbytes / (verify_s + load_s)
    return {
        "state_bytes": nbytes, "dd_write_GBps": dd_w / 1e9, "dd_read_GBps": dd_r / 1e9,
        "save_GBps": save_bw / 1e9, "save_vs_dd": save_bw / dd_w, "sync_save_s": sync_s,
        "verify_s": verify_s, "load_s": load_s, "load_GBps": load_bw / 1e9, "load_vs_dd": load_bw / dd_r,
        "resume_s": resume_s, "async_save_call_s": save_call_s, "async_hook_wait_s": hook_wait_s,
        "async_stall_s": stall_s, "async_stall_ratio": stall_s / sync_s,
        # Informational: on a shared 2-core VM the background copy, write and hash also
        # slow the loop's compute (CPU and memory bandwidth), which no stall measure shows.
        "async_loop_extra_s_per_save": loop_extra_s, "async_loop_ratio": loop_extra_s / sync_s,
    }


if __name__ == "__main__":
    raise SystemExit(main())
