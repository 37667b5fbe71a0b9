"""Model registry: built-in names, or any user model given as ``package.module:NAME``
(a factory or an ``nn.Module`` class; see :mod:`hpctrain.models.user`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hpctrain.models.registry import (
        GPT,
        REGISTRY,
        ModelError,
        ModelSpec,
        build_model,
        check_model_output,
        count_parameters,
    )

__all__ = ["GPT", "REGISTRY", "ModelError", "ModelSpec", "build_model", "check_model_output", "count_parameters"]


def __getattr__(name: str) -> Any:
    # Lazy (PEP 562): importing the package needs no torch (a login node's config check); the
    # registry builds models.
    if name in __all__:
        from hpctrain.models import registry  # torch: only when a model is built

        return getattr(registry, name)
    raise AttributeError(f"module 'hpctrain.models' has no attribute {name!r}")
