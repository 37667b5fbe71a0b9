"""The core layer: what every other layer may use and which uses none of them (errors, config
fields, the environment, caches, the run lock, safe unpickling, atomic I/O, and the launcher <->
rank protocol). See docs/architecture.md."""

import importlib
import importlib.util
from typing import Any


def __getattr__(name: str) -> Any:
    """`hpctrain.core.env` after a bare `import hpctrain` (as the top package allows for its own)."""
    if importlib.util.find_spec(f"{__name__}.{name}") is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return importlib.import_module(f"{__name__}.{name}")
