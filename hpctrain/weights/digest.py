"""A model's parameter names without the wrappers' module levels, and the sha256 of its
weights (``params_sha256``): equal hashes = equal weights, whatever the layout that held them."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import TYPE_CHECKING

from hpctrain.core.errors import RunError

if TYPE_CHECKING:
    import torch
    from torch import nn


# Wrappers that insert a module level: activation checkpointing, torch.compile (their state
# dicts drop it; named_parameters keeps it).
_WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.")


def clean_name(name: str) -> str:
    """A parameter's name in the user's model, without the wrappers' module levels."""
    for wrapper in _WRAPPERS:
        name = name.replace(wrapper, "")
    return name


def param_names(model: nn.Module) -> list[str]:
    """The model's parameter names (shared parameters once, by their first name), unwrapped."""
    return [clean_name(name) for name, _ in model.named_parameters()]


class ParamsHash:
    """:func:`params_sha256` fed one tensor at a time, in sorted-name order (the order a
    streamed model.pt is written in); names not among the parameters (buffers, a tied
    weight's second name) are skipped. A missing parameter or an out-of-order one is a bug
    of the caller and raises."""

    def __init__(self, names: Iterable[str]) -> None:
        self._names = sorted(set(names))
        self._wanted = set(self._names)
        self._done = 0
        self._digest = hashlib.sha256()

    def update(self, name: str, tensor: torch.Tensor) -> None:
        if name not in self._wanted:
            return
        if self._done >= len(self._names) or self._names[self._done] != name:
            raise RunError(f"params_sha256: parameter {name!r} came out of sorted-name order")
        import torch  # loaded already: the caller holds a tensor

        self._done += 1
        self._digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())

    def hexdigest(self) -> str:
        if self._done != len(self._names):
            missing = ", ".join(self._names[self._done:][:3])
            raise RunError(f"params_sha256: {len(self._names) - self._done} parameters never came ({missing}, ...)")
        return self._digest.hexdigest()


def params_sha256(model: nn.Module, full: dict[str, torch.Tensor] | None = None) -> str:
    """sha256 of every parameter's bytes, in sorted name order: equal hashes = equal weights.
    ``full``: the whole tensors by (unwrapped) name, when ``model`` holds shards."""
    # Wrappers insert one uniform level below a common prefix, so sorting the wrapped names
    # and sorting the unwrapped ones give the same order (ParamsHash sorts the unwrapped).
    params = dict(model.named_parameters())
    digest = ParamsHash(clean_name(name) for name in params)
    for name, param in sorted(params.items(), key=lambda item: clean_name(item[0])):
        digest.update(clean_name(name), param if full is None else full[clean_name(name)])
    return digest.hexdigest()
