"""Fixtures the trainer's tests share."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def shards(shakespeare_shards: Path) -> Path:
    """The session's Shakespeare shards (tests/conftest.py), under the name the GPT tests use."""
    return shakespeare_shards
