"""Where hpctrain keeps what it can rebuild: indexes of read-only data, the sharded
Shakespeare corpus, the CPU matmul peak probe, compiled extensions."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$HPCTRAIN_CACHE``, else ``$XDG_CACHE_HOME/hpctrain``, else ``~/.cache/hpctrain``."""
    explicit = os.environ.get("HPCTRAIN_CACHE")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hpctrain"
