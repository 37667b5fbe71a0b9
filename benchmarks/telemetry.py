"""Telemetry overhead: the straggler all-gather per call, against a bare all-gather of the
same three floats, on N real gloo ranks; plus the one-off costs (FLOP count, CPU probe).

    python benchmarks/telemetry.py [--ranks 2] [--calls 200] [--json out.json]

The straggler gather runs once per interval (about once a minute), never per step; the
figure that matters is its cost per call against the step time it would share an
interval with, printed for a 100 ms step as if it ran at every step (the worst case).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hpctrain.core.env import ClusterEnv, init_distributed, teardown


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _timed(fn: Any, calls: int) -> list[float]:
    times = []
    for _ in range(calls):
        dist.barrier()  # every rank enters together: the cost of the call, not of skew
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def _rank(rank: int, world: int, port: int, calls: int, queue: Any) -> None:
    from hpctrain.telemetry.stragglers import StragglerDetector

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env = ClusterEnv(rank=rank, local_rank=rank, world_size=world, local_world_size=world,
                     master_addr="127.0.0.1", master_port=port, source="slurm")
    init_distributed(env, "gloo", timeout_s=60)
    try:
        detector = StragglerDetector()
        bare_out = torch.empty(3 * world, dtype=torch.float64)
        gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
        bare = _timed(lambda: gather(bare_out, torch.tensor([0.1, 0.01, 0.08], dtype=torch.float64)), calls)
        full = _timed(lambda: detector.gather(0, 0.1, 0.01, 0.08), calls)
        queue.put((rank, statistics.median(bare), statistics.median(full)))
    finally:
        teardown()


def straggler_overhead(world: int, calls: int) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, calls, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=300) for _ in range(world)]
    for p in procs:
        p.join()
    bare = max(r[1] for r in results)
    full = max(r[2] for r in results)
    return {"ranks": world, "calls": calls, "bare_all_gather_us": bare * 1e6, "straggler_gather_us": full * 1e6,
            "share_of_100ms_step_if_every_step": full / 0.1}


def one_off_costs() -> dict[str, float]:
    from hpctrain.models import build_model
    from hpctrain.telemetry.flops import cpu_matmul_peak, forward_flops

    model = build_model("simple_cnn")
    times = []
    for _ in range(2):  # the first call also pays for lazy imports of the meta kernels
        start = time.perf_counter()
        count = forward_flops(model, torch.randn(64, 3, 32, 32))
        times.append(time.perf_counter() - start)
    with tempfile.TemporaryDirectory() as cache:
        start = time.perf_counter()
        peak = cpu_matmul_peak(torch.float32, Path(cache))
        probe_s = time.perf_counter() - start
    return {"simple_cnn_forward_flops_batch64": float(count), "flop_count_first_s": times[0],
            "flop_count_s": times[1], "cpu_probe_s": probe_s, "cpu_peak_gflops": peak / 1e9,
            "threads": float(torch.get_num_threads())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args()
    figures = {"straggler": straggler_overhead(args.ranks, args.calls), "one_off": one_off_costs(),
               "host": socket.gethostname(), "cpus": os.cpu_count(), "torch": torch.__version__}
    s, o = figures["straggler"], figures["one_off"]
    print(f"straggler gather, {s['ranks']} gloo ranks, median of {s['calls']} calls: "
          f"{s['straggler_gather_us']:.0f} us (bare all_gather_single: {s['bare_all_gather_us']:.0f} us); "
          f"{100 * s['share_of_100ms_step_if_every_step']:.2f}% of a 100 ms step if run every step")
    print(f"FLOP count of simple_cnn (batch 64, meta): {o['flop_count_first_s'] * 1e3:.0f} ms first call, "
          f"{o['flop_count_s'] * 1e3:.0f} ms after -> "
          f"{o['simple_cnn_forward_flops_batch64'] / 1e9:.2f} GFLOP forward")
    print(f"CPU matmul probe: {o['cpu_probe_s']:.2f} s once -> {o['cpu_peak_gflops']:.1f} GFLOP/s "
          f"at {o['threads']:.0f} threads (cached afterwards)")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
