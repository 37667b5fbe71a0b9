"""Tiny user models for tests, loaded as ``model.name=tests.models:NAME`` (shared by all tests)."""

from __future__ import annotations

from torch import nn


def tiny_mlp(num_classes: int = 10) -> nn.Module:
    """128 -> 32 -> classes, no dropout: runs on synthetic_tiny, deterministic across world sizes."""
    return nn.Sequential(nn.Linear(128, 32), nn.ReLU(), nn.Linear(32, num_classes))


def tiny_linear(num_classes: int = 10) -> nn.Module:
    """One Linear 128 -> classes (the per-step overhead benchmark's model)."""
    return nn.Linear(128, num_classes)
