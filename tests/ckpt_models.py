"""Tiny user models for the checkpoint tests (``model.name=tests.ckpt_models:tiny_mlp``).

Dropout makes the RNG part of the state: a resume that forgets it diverges."""

from __future__ import annotations

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
