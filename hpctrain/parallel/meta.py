"""Build a model on the meta device, shard it, then load the one-process initial weights.

Initialising the shards in place (``reset_parameters`` after ``to_empty``) does not give a
one-process init: on a CPU mesh every rank draws the same values, and the random stream
differs from an unsharded model's anyway. So rank 0 builds the model once, seeded as one
process would (host memory only), and its full state is scattered into the shards.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


def on_meta(factory: Callable[[], nn.Module]) -> nn.Module:
    """The model's structure without memory for its weights."""
    with torch.device("meta"):
        return factory()


def materialize(model: nn.Module, *, device: torch.device, factory: Callable[[], nn.Module], seed: int) -> None:
    """Give the parallelized meta ``model`` the weights of ``torch.manual_seed(seed); factory()``
    (built on rank 0 only, in host memory), persistent buffers and non-persistent ones alike."""
    aliases = _aliases(model)
    model.to_empty(device=device)
    _retie(model, aliases)
    rank0 = dist.get_rank() == 0
    full = None
    if rank0:
        torch.manual_seed(seed)
        full = factory()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict  # 0.8 s: FSDP only

    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full.state_dict() if full is not None else {}, options=options)
    _broadcast_other_buffers(model, full, device)


def _aliases(model: nn.Module) -> list[tuple[str, str]]:
    """(alias, first name) of each parameter registered under several names (tied weights)."""
    first: dict[int, str] = {}
    out = []
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            out.append((name, first[id(param)]))
        else:
            first[id(param)] = name
    return out


def _retie(model: nn.Module, aliases: list[tuple[str, str]]) -> None:
    """``to_empty()`` gives a module's tied parameters one tensor each (FSDP keeps them tied,
    a model without FSDP, e.g. tensor parallel at dp=1, does not): share them again."""
    for alias, name in aliases:
        param = model.get_parameter(name)
        if model.get_parameter(alias) is not param:
            owner, _, leaf = alias.rpartition(".")
            setattr(model.get_submodule(owner), leaf, param)


def _broadcast_other_buffers(model: nn.Module, full: nn.Module | None, device: torch.device) -> None:
    """Non-persistent buffers (a causal mask, rotary tables) are in no state dict: send rank 0's."""
    persistent = {_clean(k) for k in model.state_dict()}
    source = dict(full.named_buffers()) if full is not None else {}
    for name, buffer in model.named_buffers():
        name = _clean(name)
        if name in persistent:
            continue
        if full is not None:
            buffer.copy_(source[name])
        staged = buffer.detach().to(_collective_device(device))
        dist.broadcast(staged, src=0)
        buffer.copy_(staged)


def _collective_device(device: torch.device) -> torch.device:
    return device if dist.get_backend() == "nccl" else torch.device("cpu")


def _clean(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name
