"""How a config section is declared; the one module every ``*/config.py`` imports.

A section is a ``@dataclass(frozen=True, kw_only=True)`` next to its component
(``data/config.py``, ``checkpoint/config.py``, ...): read-only once built, no positional
mix-ups. Each field is documented once, in :func:`opt`'s help text, which is also the
generated reference (``hpctrain config doc``). A section checks its own values in
``__post_init__`` and only raises: nothing is rewritten after construction. This module
imports nothing from hpctrain but the error hierarchy, so a component can import its
section without an import cycle through :mod:`hpctrain.config`.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
from collections.abc import Callable
from dataclasses import field
from typing import Any, Literal, TypeVar

from hpctrain.core.errors import UserError

T = TypeVar("T")

PrecisionMode = Literal["fp32", "bf16", "fp16", "fp8"]  # the top-level config key `precision`


class ConfigError(UserError):
    """A configuration value or key is wrong; the message says which and how to fix it."""


def opt(default: Any, help: str, *, none_text: tuple[str, ...] = ()) -> Any:
    """A config field with its documentation. ``none_text``: words that mean None when given as
    text (e.g. ``off``), turned into None while the value is read, never afterwards."""
    metadata = {"help": help, "none_text": none_text}
    if isinstance(default, (list, dict)):
        factory: Callable[[], Any] = lambda: type(default)(default)  # noqa: E731 - a fresh copy per instance
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def sub(cls: type[T]) -> T:
    """A nested section field: ``data: DataConfig = sub(DataConfig)``."""
    return field(default_factory=cls)


def positive(section_name: str, obj: Any, *names: str) -> None:
    """Each named field is None or > 0; the message names ``section.key`` and the value."""
    for name in names:
        value = getattr(obj, name)
        # "not > 0" refuses nan too (nan <= 0 is false), and inf is no size or budget
        if value is not None and (not value > 0 or value == float("inf")):
            raise ConfigError(f"{section_name}.{name}={value!r} must be > 0" + ("" if value <= 0 else " and finite"))


def at_least(section_name: str, obj: Any, name: str, low: float) -> None:
    value = getattr(obj, name)
    if value < low:
        raise ConfigError(f"{section_name}.{name}={value!r} must be >= {low}")


def to_dict(cfg: Any) -> dict[str, Any]:
    """A config (or section) as plain dicts and lists, e.g. for YAML or a checkpoint."""
    return dataclasses.asdict(cfg)


def _import_here_too(module_name: str) -> Any:
    """``import module_name``, also from the current directory, as ``python -m`` finds it (the
    ``hpctrain`` console script does not put the directory it is run from on ``sys.path``)."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        here = os.getcwd()
        if err.name != module_name.split(".")[0] or here in sys.path or "" in sys.path:
            raise
        sys.path.append(here)  # after the installed packages: never shadows one of them
        return importlib.import_module(module_name)


def load_import_path(key: str, value: str, error: type[UserError] | None = None) -> Any:
    """The object ``package.module:NAME`` names (``NAME`` may be dotted), or ``error`` (default
    :class:`ConfigError`, exit 2) naming ``key`` and ``value`` with a hint."""
    fail = error or ConfigError
    module_name, _, attr = value.partition(":")
    try:
        obj: Any = _import_here_too(module_name)
    except Exception as err:  # noqa: BLE001 - any import-time failure of user code is the user's to fix
        raise fail(f"{key}={value!r}: cannot import {module_name!r} ({type(err).__name__}: {err}); "
                   "hint: is the package installed, or its directory on PYTHONPATH?") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise fail(f"{key}={value!r}: module {module_name!r} has no {attr!r}; hint: check the "
                       "spelling after the colon (case matters)")
        obj = getattr(obj, part)
    return obj
