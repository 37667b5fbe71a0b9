"""Run a function on N real gloo ranks (spawned processes) and collect what each returns."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pickle
import signal
import socket
import subprocess
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from hpctrain.core.env import ClusterEnv, init_distributed, teardown


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple, queue: Any,
            environ: dict[str, str]) -> None:
    os.environ.clear()  # a forkserver child starts with the server's environment: take the test's
    os.environ.update(environ)
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


_CONTEXT: Any = None


def _context() -> Any:
    """Ranks are forked from a server that imported torch and hpctrain once: each is still a fresh
    process (no process group, no threads, no state of earlier tests), but starts in ~0.3 s instead
    of the 5-15 s a spawned interpreter needs to import them. torch._dynamo too: the first
    optimizer a process builds imports it (torch.optim's constructor; it brings FSDP and DTensor),
    ~1.3 s of CPU that every rank paid again (starts no thread). DeepSpeed picks its accelerator
    when imported: it is preloaded only where torch has no CUDA (it then picks the CPU, as the ranks
    would; with CUDA it would touch the devices in the server, before the fork)."""
    global _CONTEXT
    if _CONTEXT is None:
        preload = ["torch", "torch.distributed", "torch._dynamo", "hpctrain.train", "tests.dist_utils",
                   "tests.sharding_models"]
        if torch.version.cuda is None and importlib.util.find_spec("deepspeed") is not None:
            preload.append("tests.deepspeed_cpu")
        _CONTEXT = mp.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(preload)
    return _CONTEXT


def run_ranks(world: int, fn: Callable[..., Any], *args: Any, timeout: float = 120) -> list[Any]:
    """``fn(env, *args)`` on ranks 0..world-1; returns results in rank order, raises on any failure.

    ``fn`` must be importable (module level) so spawned processes can find it.
    """
    if world == 1:
        return [fn(ClusterEnv(), *args)]
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    environ = dict(os.environ)
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, queue, environ), daemon=True)
             for r in range(world)]
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



def _train_each(env: ClusterEnv, cases: list[tuple[str, list[str]]], root: str,
                keep: tuple[str, ...] | None) -> dict[str, Any]:
    """Each case through ``train`` in this group of ranks' process group; a case that fails is
    reported by name (its error's last line) and the others still run."""
    from hpctrain.config import load_config
    from hpctrain.train import train

    out: dict[str, Any] = {}
    for name, keys in cases:
        try:
            summary = train(load_config(None, [*keys, f"run.dir={root}/{name}"]), env)
        except Exception as err:  # noqa: BLE001 - reported per case by the test
            text = str(err).strip()
            out[name] = f"{type(err).__name__}: {text.splitlines()[-1] if text else ''}"
            continue
        out[name] = {k: summary[k] for k in keep} if keep else summary
    return out


def train_cases(world: int, cases: list[tuple[str, list[str]]], root: Path, *,
                keep: tuple[str, ...] | None = None, timeout: float = 900) -> list[dict[str, Any]]:
    """Train every ``(name, config keys)`` case in turn on one set of ``world`` forked ranks (one
    torch import and one process group for all; each case's run dir is ``root/name``). Returns,
    per rank, ``{name: summary (its ``keep`` keys) or "ErrorType: last line"}``. For what only
    tests the trainer; signals, launchers and Slurm keep their real subprocesses."""
    return run_ranks(world, _train_each, cases, str(root), keep, timeout=timeout)

# Every test runs its ranks on this one host: pin gloo to loopback, so a container whose
# hostname does not resolve still connects. Subprocesses inherit it; the real 2-node Slurm
# tests drop it again (tests/slurm/cluster.py base_env), as their nodes talk over veths.
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER_PREFIXES = ("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "SLURM_", "TORCHELASTIC_", "GROUP_RANK")


def launch_env(**extra: str) -> dict[str, str]:
    """The environment for an `hpctrain` / torchrun subprocess started by a test: this
    process's, without launcher variables (the child is a fresh job), with the checkout on
    PYTHONPATH, gloo on loopback and one thread per rank; ``extra`` on top."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_PREFIXES)}
    env.update(PYTHONPATH=f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}", GLOO_SOCKET_IFNAME="lo",
               OMP_NUM_THREADS="1", **extra)
    return env


def finish_launch(proc: subprocess.Popen[bytes], timeout: float) -> tuple[int, str]:
    """Wait for a launcher started with ``start_new_session=True``; on time-out kill it, its
    group and its ranks (torch starts each rank in a session of its own, out of the group's
    reach, and a live rank would keep the output pipe open), then fail with the output."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for child in _descendants(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=60)
        pytest.fail(f"run timed out:\n{out.decode(errors='replace')[-4000:]}")
    return proc.returncode, out.decode(errors="replace")


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (read from /proc before anything is killed)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found
