"""Tiny user models for tests, loaded as ``model.name=tests.models:NAME`` (shared by all tests)."""

from __future__ import annotations

from torch import nn


def tiny_mlp(num_classes: int = 10) -> nn.Module:
    """128 -> 32 -> classes, no dropout: runs on synthetic_tiny, deterministic across world sizes."""
    return nn.Sequential(nn.Linear(128, 32), nn.ReLU(), nn.Linear(32, num_classes))


def tiny_linear(num_classes: int = 10) -> nn.Module:
    """One Linear 128 -> classes (the per-step overhead benchmark's model)."""
    return nn.Linear(128, num_classes)


class _Slow(nn.Module):
    """Sleeps in forward so a signal can be sent while training is surely still running."""

    def __init__(self, inner: nn.Module, seconds: float) -> None:
        super().__init__()
        self.inner, self.seconds = inner, seconds

    def forward(self, x):  # noqa: ANN001, ANN201
        import time

        if self.training:
            time.sleep(self.seconds)
        return self.inner(x)


def slow_mlp(num_classes: int = 10) -> nn.Module:
    """tiny_mlp whose training forward takes >= 20 ms (same weights and results as tiny_mlp)."""
    return _Slow(tiny_mlp(num_classes), 0.02)
