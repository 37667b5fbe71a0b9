"""Checkpoint I/O against dd, torch.save and torch.distributed.checkpoint, in the same run,
on the same state, interleaved round by round: the measuring code of ``benchmarks/checkpoint.py``
(whose docstring describes every figure) and ``hpctrain bench checkpoint``.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from bench.pagecache import evict
from hpctrain.checkpoint import checksum, layout, tensorfile
from hpctrain.checkpoint.checkpointer import Checkpointer, load_replicated
from hpctrain.checkpoint.checksum import DEFAULT
from hpctrain.checkpoint.state import REPLICATED_TENSORS, RNG, snapshot
from hpctrain.checkpoint.writer import CheckpointWriter
from hpctrain.config import load_config, to_dict
from hpctrain.core.env import ClusterEnv
from hpctrain.data import TrainLoader
from hpctrain.parallel.state import WholeState
from hpctrain.precision import Precision
from hpctrain.train import Counters

CPU = torch.device("cpu")
CFG = to_dict(load_config(None, ["checkpoint.every_seconds=None"]))  # the config saved with the state


class _Loader:
    def state_dict(self) -> dict[str, int]:
        return {"epoch": 0, "batches_done": 0}

    def load_state_dict(self, state: dict[str, int]) -> None:
        pass


@dataclass
class Parts:
    """What the benchmark checkpoints: a model, its optimizer, counters and a loader's position."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    counters: Counters = field(default_factory=Counters)
    loader: TrainLoader = field(default_factory=lambda: cast(TrainLoader, _Loader()))

    def state(self) -> dict[str, Any]:
        """The Checkpointer's mapping of Stateful objects."""
        return {"model": WholeState(self.model, self.optimizer), "scheduler": None,
                "scaler": Precision("fp32", CPU), "counters": self.counters, "loader": self.loader, "rng": RNG(CPU)}


def build_parts(gb: float, width: int = 4096) -> Parts:
    """Linear layers of ``width`` x ``width`` fp32 (64 MiB each at 4096) adding up to ``gb`` GB;
    SGD without momentum, so the model is the whole state."""
    layers = max(1, round(gb * 1e9 / (width * width * 4)))
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
    return Parts(model, torch.optim.SGD(model.parameters(), lr=0.1))


def state_bytes(parts: Parts) -> int:
    return sum(p.numel() * p.element_size() for p in parts.model.parameters())


def dd_write(path: Path, nbytes: int) -> float:
    """Seconds for dd to write ``nbytes`` (rounded up to 16 MiB blocks) with O_DIRECT and fsync."""
    count = -(-nbytes // (16 << 20))
    start = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=16M", f"count={count}", "oflag=direct", "conv=fsync"],
                   check=True, capture_output=True)
    return (time.perf_counter() - start) * nbytes / (count * (16 << 20))


def dd_read(path: Path) -> float:
    """Seconds for dd to read ``path`` with O_DIRECT, from a cold page cache."""
    evict(path)
    start = time.perf_counter()
    subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=16M", "iflag=direct"], check=True, capture_output=True)
    return time.perf_counter() - start


def timed_saves(writer: CheckpointWriter, parts: Parts, steps: list[int]) -> list[float]:
    times = []
    for step in steps:
        parts.counters.step = step
        start = time.perf_counter()
        writer.save(snapshot(parts.state(), ClusterEnv(), CFG, {}), blocking=True)
        times.append(time.perf_counter() - start)
    return times


def timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def torch_save(model: nn.Module, path: Path) -> None:
    with open(path, "wb") as fh:
        torch.save(model.state_dict(), fh)
        fh.flush()
        os.fsync(fh.fileno())


def torch_load(model: nn.Module, path: Path) -> None:
    model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))


def dcp_save(model: nn.Module, path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    shutil.rmtree(path, ignore_errors=True)
    writer = dcp.FileSystemWriter(str(path), sync_files=True)
    dcp.save({"model": model.state_dict()}, storage_writer=writer, no_dist=True)


def dcp_load(model: nn.Module, path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    state = {"model": model.state_dict()}  # DCP loads in place: into the live parameters
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)


def rotated(items: list[Any], r: int) -> list[Any]:
    """``items`` started at position ``r``: round r runs them in another order, so a busy machine's
    drift within a round does not always hit the same method."""
    k = r % len(items)
    return items[k:] + items[:k]


def one_pass_load(parts: Parts, ckpt: Path) -> None:
    """What resume does: every file read once and checked against the manifest while read."""
    files = layout.read_manifest(ckpt)["files"]
    state = load_replicated(ckpt, _live(parts), files)
    parts.model.load_state_dict(state["model"])


def two_pass_load(parts: Parts, ckpt: Path) -> None:
    """The earlier resume: hash every file, then read them again into the model."""
    assert layout.verify(ckpt) == []
    state = load_replicated(ckpt, _live(parts))
    parts.model.load_state_dict(state["model"])


def bench_io(scratch: Path, parts: Parts, repeats: int) -> tuple[dict[str, list[float]], str]:
    """Seconds per method, one sample per round, and the default checkpoint.hash's algorithm.
    hpctrain saves and loads twice: with the default checksum and with checkpoint.hash=sha256.
    The methods alternate within each round, in a rotated order, so drift in a busy machine's
    load hits them alike."""
    model, nbytes = parts.model, state_bytes(parts)
    roots = {"": scratch / "run" / "checkpoints", "_sha256": scratch / "sha256" / "checkpoints"}
    writers = {suffix: CheckpointWriter(root, ClusterEnv(), keep_last=1, hash="sha256" if suffix else DEFAULT)
               for suffix, root in roots.items()}
    times: dict[str, list[float]] = {}

    def add(name: str, seconds: float) -> None:
        times.setdefault(name, []).append(seconds)

    for writer in writers.values():
        timed_saves(writer, parts, [1])  # warm-up: page-aligned buffers, hash threads
    for r in range(repeats):
        add("dd_write", dd_write(scratch / "dd.bin", nbytes))
        saves: list[tuple[str, Callable[[], Any]]] = [
            ("torch_save", partial(torch_save, model, scratch / "torch.pt")),
            ("dcp_save", partial(dcp_save, model, scratch / "dcp"))]
        saves += [(f"hpctrain_save{suffix}", partial(timed_saves, w, parts, [2 + r])) for suffix, w in writers.items()]
        for name, fn in rotated(saves, r):
            add(name, timed(fn))
        ckpts = {suffix: layout.committed(root)[-1][1] for suffix, root in roots.items()}
        tensors = ckpts[""] / REPLICATED_TENSORS
        add("dd_read", dd_read(tensors))
        loads = [("torch_load", scratch / "torch.pt", partial(torch_load, model, scratch / "torch.pt")),
                 ("dcp_load", scratch / "dcp", partial(dcp_load, model, scratch / "dcp")),
                 ("two_pass_load", ckpts[""], partial(two_pass_load, parts, ckpts[""]))]
        loads += [(f"hpctrain_load{suffix}", c, partial(one_pass_load, parts, c)) for suffix, c in ckpts.items()]
        for name, path, fn in rotated(loads, r):
            evict(path)
            add(name, timed(fn))
        add("file_bytes", float(tensors.stat().st_size))
    for writer in writers.values():
        writer.close()
    return times, writers[""].algorithm.name


def bench_resume(root: Path, parts: Parts, repeats: int) -> float:
    """Median of Checkpointer.resume("auto") end to end (pick, read + check, restore), cold cache."""
    cfg = load_config(None, ["checkpoint.every_seconds=None"])
    times = []
    for _ in range(repeats):
        evict(root)
        ckpt = Checkpointer(root.parent, ClusterEnv(), CPU, cfg.checkpoint, parts.state())
        start = time.perf_counter()
        assert ckpt.resume("auto")
        times.append(time.perf_counter() - start)
        ckpt.close()
        ckpt.signals.uninstall()
    return statistics.median(times)


def bench_async(root: Path, parts: Parts, repeats: int, step_s: float) -> tuple[float, float, float]:
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
                writer.save(snapshot(parts.state(), ClusterEnv(), CFG, {}), defer=_mutable(parts))
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


def hash_speeds(nbytes: int) -> dict[str, float]:
    """GB/s of one stream of each checkpoint.hash algorithm installed here, over ``nbytes`` in
    16 MiB updates, best of 3 (why xxh3 is the default: docs/checkpointing.md)."""
    view = memoryview(bytearray(range(256)) * (nbytes // 256))
    out = {}
    for algorithm in checksum.ALGORITHMS.values():
        if not algorithm.available():
            continue
        best = float("inf")
        for _ in range(3):
            start, digest = time.perf_counter(), algorithm.new()
            for offset in range(0, len(view), 16 << 20):
                digest.update(view[offset : offset + (16 << 20)])
            digest.digest()
            best = min(best, time.perf_counter() - start)
        out[f"hash_GBps_{algorithm.name}"] = len(view) / best / 1e9
    return out


def against_peers(t: dict[str, list[float]]) -> dict[str, Any]:
    """hpctrain against the faster of torch and DCP in the same round (> 1: hpctrain is faster),
    per round and the median of the rounds, for saves and loads, with either checksum."""
    out: dict[str, Any] = {}
    for op in ("save", "load"):
        best = [min(a, b) for a, b in zip(t[f"torch_{op}"], t[f"dcp_{op}"])]
        for suffix in ("", "_sha256"):
            ratios = [p / h for p, h in zip(best, t[f"hpctrain_{op}{suffix}"])]
            out[f"hpctrain_{op}{suffix}_vs_best_peer_per_round"] = [round(x, 3) for x in ratios]
            out[f"hpctrain_{op}{suffix}_vs_best_peer"] = statistics.median(ratios)
    return out


def _mutable(parts: Parts) -> set[int]:
    return WholeState(parts.model, parts.optimizer).step_storages()


def _time_step(fn: Any) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(10):
        fn()
    return (time.perf_counter() - start) / 10


def run(scratch: Path, gb: float, repeats: int, step_s: float, width: int = 4096) -> dict[str, Any]:
    """Every figure of the benchmark, on a state of ``gb`` GB in ``scratch`` (which it fills)."""
    parts = build_parts(gb, width)
    nbytes = state_bytes(parts)
    t, algorithm = bench_io(scratch, parts, repeats)
    med = {name: statistics.median(values) for name, values in t.items()}
    dd_w, dd_r = nbytes / med["dd_write"], med["file_bytes"] / med["dd_read"]  # dd_* hold seconds per byte count
    resume_s = bench_resume(scratch / "run" / "checkpoints", parts, repeats)
    save_call_s, hook_wait_s, loop_extra_s = bench_async(scratch / "async" / "checkpoints", parts, repeats, step_s)
    stall_s = save_call_s + hook_wait_s
    out: dict[str, Any] = {"state_bytes": nbytes, "repeats": repeats, "hash": algorithm,
                           "load_avg_1m": os.getloadavg()[0], "dd_write_GBps": dd_w / 1e9, "dd_read_GBps": dd_r / 1e9}
    for name in ("torch_save", "dcp_save", "hpctrain_save", "hpctrain_save_sha256"):
        out[f"{name}_s"] = med[name]
        out[f"{name}_vs_dd"] = nbytes / med[name] / dd_w
    for name in ("torch_load", "dcp_load", "hpctrain_load", "hpctrain_load_sha256", "two_pass_load"):
        out[f"{name}_s"] = med[name]
        out[f"{name}_vs_dd"] = nbytes / med[name] / dd_r
    # Per round, so a noisy round compares with its own dd: the median of the ratios.
    out["hpctrain_load_vs_dd_per_round"] = [round(d / h, 3) for d, h in zip(t["dd_read"], t["hpctrain_load"])]
    out.update(against_peers(t))
    out.update(hash_speeds(min(nbytes, 256 << 20)))
    out.update({
        "resume_s": resume_s, "async_save_call_s": save_call_s, "async_hook_wait_s": hook_wait_s,
        "async_stall_s": stall_s, "async_stall_ratio": stall_s / med["hpctrain_save"],
        # Informational: on a shared 2-core VM the background copy, write and hash also
        # slow the loop's compute (CPU and memory bandwidth), which no stall measure shows.
        "async_loop_extra_s_per_save": loop_extra_s, "async_loop_ratio": loop_extra_s / med["hpctrain_save"],
    })
    return out



def _live(parts: Parts) -> dict[str, torch.Tensor]:
    """The model's live tensors under the replicated file's names: read straight into them."""
    return tensorfile.split({"model": parts.model.state_dict()})[1]
