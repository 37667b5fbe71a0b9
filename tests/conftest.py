"""Shared fixtures: no test may leave a process group behind, and none may write outside tmp."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

# Tests run on 2 cores: one thread per rank keeps multi-rank tests from oversubscribing.
torch.set_num_threads(1)
# ... and torch.compile generates its kernels in the compiling process (the same code): by default
# every compiling rank starts a pool of worker interpreters (one per core, each importing torch),
# which cost more CPU than the suite's small graphs take to compile. Subprocesses inherit it.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


@pytest.fixture(autouse=True)
def _destroy_leftover_process_group():
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _one_thread_after_each_test():
    """A test that trains in this process (``train``, ``hpctrain eval`` through ``cli.main``) sets
    torch's threads from the config (a core each by default): back to one, or the tests after it
    in this worker run oversubscribed beside the other workers."""
    yield
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _clean_launcher_env(monkeypatch):
    """Tests see a plain single process unless they set launcher variables themselves."""
    for name in list(os.environ):
        if name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                    "GROUP_RANK") or name.startswith(("SLURM_", "TORCHELASTIC_")):
            monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="session")
def shakespeare_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A dozen plays (h*, m*) as 32-token windows, packed once per test session for every
    GPT test (fast; the whole corpus is data.name=shakespeare)."""
    from hpctrain.data.text import write_text_shards

    out = tmp_path_factory.mktemp("shakespeare") / "s"
    write_text_shards("shakespeare", out, seq_len=32, glob="*shksprdata/texts/[hm]*_gut.txt")
    return out


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups into the scopes
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """With pytest-xdist (pyproject's addopts: ``-n 3 --dist loadgroup``): each file runs whole on
    one worker (its module fixtures once, its launches in order), and the tests that bring up a
    Slurm or a second host (network namespaces, fixed names) share one worker, one after another."""
    groups: dict[pytest.Item, str] = {}
    for item in items:
        shared = item.get_closest_marker("slurm") or item.get_closest_marker("multinode")
        groups[item] = "cluster" if shared else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(groups[item]))
    # the longest groups first (pyproject: --no-loadscope-reorder keeps this order), so that no
    # worker starts the Slurm jobs or a file of launches while the others run out of work
    slow = {groups[item] for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: 0 if groups[item] == "cluster" else 1 if groups[item] in slow else 2)
