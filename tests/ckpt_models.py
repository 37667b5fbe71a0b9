"""Tiny user models for the checkpoint tests (``model.name=tests.ckpt_models:tiny_mlp``).

Dropout makes the RNG part of the state: a resume that forgets it diverges."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn


def tiny_mlp(num_classes: int = 10) -> nn.Module:
    return nn.Sequential(nn.Linear(128, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, num_classes))


class _Slow(nn.Module):
    """A forward that takes a few milliseconds, so a test can signal a run mid-epoch."""

    def __init__(self, inner: nn.Module, seconds: float) -> None:
        super().__init__()
        self.inner, self.seconds = inner, seconds

    def forward(self, x):  # type: ignore[no-untyped-def]
        import time

        time.sleep(self.seconds)
        return self.inner(x)


def slow_mlp(num_classes: int = 10) -> nn.Module:
    return _Slow(tiny_mlp(num_classes), 0.02)


@dataclass
class Parts:
    """A tiny model, its optimizer and the rest a checkpoint holds, for Checkpointer tests without a run."""

    model: nn.Module
    optimizer: Any
    counters: Any
    loader: Any
    precision: Any

    def state(self) -> dict[str, Any]:
        """The Checkpointer's mapping of Stateful objects."""
        from hpctrain.parallel.state import WholeState

        return {"model": WholeState(self.model, self.optimizer), "scheduler": None, "scaler": self.precision,
                "counters": self.counters, "loader": self.loader}


def make_parts(seed: int = 0, step: int = 1) -> Parts:
    """A tiny model with optimizer state, at ``step``."""
    import torch

    from hpctrain.precision import Precision
    from hpctrain.train import Counters

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.1), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()  # optimizer state exists
    return Parts(model, optimizer, Counters(step=step), StaticLoader(), Precision("fp32", torch.device("cpu")))


class StaticLoader:
    """The loader protocol's state part only."""

    def state_dict(self) -> dict[str, int]:
        return {"epoch": 0, "batches_done": 3}

    def load_state_dict(self, state: dict[str, int]) -> None:
        pass


# A two-epoch run of slow_mlp that a test can signal mid-epoch (the preemption and launcher tests).
SLOW_RUN_ARGS = ["model.name=tests.ckpt_models:slow_mlp", "data.name=synthetic_tiny", "data.synthetic_size=1024",
                 "data.batch_size=16", "data.max_val_samples=64", "train.epochs=2", "train.log_every=1",
                 "train.progress=false", "checkpoint.every_seconds=None", "train.threads=1"]
