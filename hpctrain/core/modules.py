"""What a parallelized model is made of, asked of the module itself: the user's module inside
wrappers, and whether this rank holds shards of it. No strategy is named here, so the
components (precision, checkpoint, weights, evaluation) can ask without importing ``parallel/``.

Core: torch is never imported here; whoever holds a module or a tensor has loaded it already.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeGuard

from hpctrain.core.env import collective_device

if TYPE_CHECKING:
    import torch
    from torch.distributed.tensor import DTensor


def is_dtensor(tensor: object) -> TypeGuard[DTensor]:
    """Is this a DTensor (a shard of FSDP2 or tensor parallelism)? Without importing
    ``torch.distributed.tensor`` (0.7 s of every rank's start-up, sympy included): until that
    module is loaded no DTensor can exist, and a DDP or one-process run never loads it."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: a DTensor's local shard, any other tensor itself."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def is_sharded(model: torch.nn.Module) -> bool:
    """Does this rank hold shards (FSDP, tensor parallel) rather than whole parameters? (FSDP's
    parameters are whole between a forward and its backward: ZeRO-2 after an eval forward.)"""
    fsdp = sys.modules.get("torch.distributed.fsdp")  # likewise: no FSDP module before it loads
    return (fsdp is not None and any(isinstance(m, fsdp.FSDPModule) for m in model.modules())) or any(
        is_dtensor(param) for param in model.parameters())


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside DDP / torch.compile wrappers (for saving and evaluation)."""
    from torch import nn  # torch: loaded already (the caller holds a module), never by this module's import

    while True:
        inner = getattr(model, "module", None)
        if not isinstance(inner, nn.Module):  # no `or`: bool() of a compiled module calls its len()
            inner = getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


# ---------------------------------------------------------------- buffers over replicas


def sync_buffers(module: torch.nn.Module, groups: Sequence[Any] = (None,)) -> int:
    """Set every buffer of ``module`` to the first rank's of each process group in ``groups``
    (None: the whole world), in turn (a collective: every rank of each group calls it). Returns
    how many buffers it covers (0 outside a process group). DTensor buffers are sharded on purpose
    and are left alone. Why rank 0's and not a mean: hpctrain.parallel.buffers' docstring."""
    import torch.distributed as dist  # torch: loaded already (the caller holds a module)

    if not (dist.is_available() and dist.is_initialized()):
        return 0
    buffers = [b for b in module.buffers() if not is_dtensor(b) and b.device.type != "meta"]
    device = collective_device()
    for group in groups:
        if dist.get_world_size(group) == 1:
            continue
        for buf in buffers:
            _broadcast(buf, group, device)
    return len(buffers)


def _broadcast(buf: torch.Tensor, group: Any, device: torch.device) -> None:
    import torch.distributed as dist  # torch: loaded already

    # gloo takes CPU tensors, NCCL CUDA ones: an offloaded (or CPU) buffer travels by a copy
    with no_grad():
        direct = buf.device == device and buf.is_contiguous()
        work = buf if direct else buf.detach().to(device).contiguous()
        dist.broadcast(work, group_src=0, group=group)
        if not direct:
            buf.copy_(work)


def no_grad() -> Any:
    import torch  # torch: loaded already

    return torch.no_grad()


# ---------------------------------------------------------------- what evaluation runs

# A wrapper's view for evaluation. A replicating wrapper (one holding the user's module as
# ``.module`` and its replicas' ``.process_group``, as torch's DistributedDataParallel does, also
# when the user wrapped it) is evaluated on its inner module after its buffers are made its first
# rank's, as its next training forward would: every rank then validates the model rank 0 saves,
# and no forward of the evaluation syncs. Other wrappers register their own view. Evaluation
# names no wrapper: it asks :func:`eval_view`.
EvalView = Callable[["torch.nn.Module"], "torch.nn.Module"]
_EVAL_VIEWS: dict[type, EvalView] = {}


def register_eval_view(wrapper: type, view: EvalView) -> None:
    """Evaluate a model wrapped in ``wrapper`` (or a subclass) through ``view(model)``."""
    _EVAL_VIEWS[wrapper] = view


def replica_view(model: torch.nn.Module) -> torch.nn.Module | None:
    """A replicating wrapper's inner module, its buffers set to its first rank's; None for any
    other module."""
    from torch import nn  # torch: loaded already (the caller holds a module)

    inner, group = getattr(model, "module", None), getattr(model, "process_group", None)
    if group is None or not isinstance(inner, nn.Module):
        return None
    sync_buffers(inner, (group,))
    return inner


def eval_view(model: torch.nn.Module) -> torch.nn.Module:
    """The module evaluation runs forwards on: the registered view of its wrapper, a replicating
    wrapper's inner module, else the model itself."""
    for kind in type(model).__mro__:
        view = _EVAL_VIEWS.get(kind)
        if view is not None:
            return view(model)
    inner = replica_view(model)
    return model if inner is None else inner
