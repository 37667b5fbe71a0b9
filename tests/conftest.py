"""Shared fixtures: no test may leave a process group behind, and none may write outside tmp."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

# Tests run on 2 cores: one thread per rank keeps multi-rank tests from oversubscribing.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _destroy_leftover_process_group():
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _clean_launcher_env(monkeypatch):
    """Tests see a plain single process unless they set launcher variables themselves."""
    for name in list(os.environ):
        if name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                    "GROUP_RANK") or name.startswith(("SLURM_", "TORCHELASTIC_")):
            monkeypatch.delenv(name, raising=False)
