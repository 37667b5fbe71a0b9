"""Run a function on N real gloo ranks (spawned processes) and collect what each returns."""

from __future__ import annotations

import os
import pickle
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from hpctrain.env import ClusterEnv, init_distributed, teardown


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple, queue: Any) -> None:
    torch.set_num_threads(1)
    env = ClusterEnv(rank=rank, local_rank=rank, world_size=world, local_world_size=world,
                     master_addr="127.0.0.1", master_port=port, source="slurm")
    try:
        init_distributed(env, "gloo", timeout_s=60)
        # Plain pickle bytes: tensors sent through an mp.Queue would live in shared memory
        # that vanishes when this process exits before the parent has read them.
        queue.put((rank, "ok", pickle.dumps(fn(env, *args))))
    except BaseException:  # report, never hang the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        teardown()


def run_ranks(world: int, fn: Callable[..., Any], *args: Any, timeout: float = 120) -> list[Any]:
    """``fn(env, *args)`` on ranks 0..world-1; returns results in rank order, raises on any failure.

    ``fn`` must be importable (module level) so spawned processes can find it.
    """
    if world == 1:
        return [fn(ClusterEnv(), *args)]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, queue), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(world):
            rank, status, value = queue.get(timeout=timeout)
            if status == "error":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]


os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
