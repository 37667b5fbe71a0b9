"""Build a model on the meta device, shard it, then load the one-process initial weights.

Initialising the shards in place (``reset_parameters`` after ``to_empty``) does not give a
one-process init: on a CPU mesh every rank draws the same values, and the random stream
differs from an unsharded model's anyway. So rank 0 builds the model once, seeded as one
process would (host memory only), and its full state is scattered into the shards.

A factory that loads weights (``from_pretrained``, ``torch.load``, a safetensors file) may refuse
the meta device (Hugging Face's ``from_pretrained`` does). Then :func:`build_structure` calls it on
rank 0 only, in host memory, and sends the other ranks its structure as a meta copy (pickled, no
weights): every rank shards that, and rank 0's loaded weights go into the shards. No rank but rank
0 ever holds or reads the whole model. Tensor, pipeline and context parallel take the same path:
:func:`load_from_rank0` sends rank 0's tensors one at a time into each rank's pipeline stage(s)
(named as in the whole model) or tensor-parallel shards, and :func:`whole_from_rank0` gives every
rank rank 0's whole model (a data-parallel wrapper wants whole modules before it cuts nothing).

Before the process group the checks of tp, pp and cp read the model's layout on meta
(:func:`meta_structure`); a factory that loads weights has none to read there (None), so those
checks run after start instead, on the structure rank 0 sends, identical on every rank (the same
exit-2 error everywhere, no rank left waiting).
"""

from __future__ import annotations

import copy
import itertools
import pickle
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from hpctrain.core.errors import HpctrainError
from hpctrain.models.user import ModelError
from hpctrain.telemetry.measure import on_meta

__all__ = ["Structure", "build_structure", "load_from_rank0", "materialize", "meta_copy", "meta_structure", "on_meta",
           "whole_from_rank0"]

_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


@dataclass
class Structure:
    """A model's structure on meta; ``full`` is rank 0's built model when the factory loads weights
    (it could not run on meta), so it is called once only (None on the other ranks, or when not loaded)."""

    skeleton: nn.Module
    full: nn.Module | None = None
    loaded: bool = False  # the factory could not run on meta: rank 0 built it (the same on every rank)


def build_structure(factory: Callable[[], nn.Module], *, seed: int) -> Structure:
    """The model's structure without memory: ``factory()`` on meta, or, when it refuses the meta
    device (it loads weights), rank 0's ``torch.manual_seed(seed); factory()`` in host memory
    and its meta copy sent to every rank. Collective when the factory refuses meta."""
    try:
        return Structure(on_meta(factory))
    except Exception:  # noqa: BLE001 - any refusal on meta: build it for real, on rank 0 only
        if not (dist.is_available() and dist.is_initialized()):
            raise
    full, sent = None, None
    if dist.get_rank() == 0:
        full, sent = _build_on_rank0(factory, seed)
    box: list[object] = [sent]
    dist.broadcast_object_list(box, src=0)  # the structure (meta tensors pickle without data), or the error
    if isinstance(box[0], BaseException):
        raise box[0]
    assert isinstance(box[0], nn.Module)
    return Structure(box[0], full, loaded=True)


def meta_structure(factory: Callable[[], nn.Module]) -> nn.Module | None:
    """``factory()`` on meta (no memory), or None when it refuses the meta device: a factory that
    loads weights (Hugging Face's ``from_pretrained`` raises there), whose structure only building
    it tells; the checks that read it then run on rank 0's structure after start."""
    try:
        return on_meta(factory)
    except Exception:  # noqa: BLE001 - any refusal on meta: not knowable without loading the weights
        return None


def _build_on_rank0(factory: Callable[[], nn.Module], seed: int) -> tuple[nn.Module | None, object]:
    """Rank 0's full model and what it sends: its meta copy, or the error (the other ranks raise it too)."""
    try:
        torch.manual_seed(seed)
        with torch.device("cpu"):  # host memory: the device gets only this rank's shards
            full = factory()
        skeleton = meta_copy(full)
        pickle.dumps(skeleton)  # here, not inside the broadcast: a failure there leaves the others waiting
    except HpctrainError as err:
        return None, err
    except Exception as err:  # noqa: BLE001 - the structure does not pickle: say what to do
        return None, ModelError(f"the model loads weights (it cannot be built on the meta device), so rank 0 builds "
                                f"it and sends its structure to the other ranks, but it does not pickle: "
                                f"{type(err).__name__}: {err}; hint: parallel.strategy=ddp, or build the model "
                                "from its config and load the weights in the factory with torch.load")
    return full, skeleton


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are on meta: its structure, no memory."""
    memo: dict[int, object] = {}
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        empty = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = nn.Parameter(empty, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else empty
    return copy.deepcopy(model, memo)


def materialize(model: nn.Module, *, device: torch.device, factory: Callable[[], nn.Module], seed: int,
                full: nn.Module | None = None) -> None:
    """Give the parallelized meta ``model`` the weights of ``torch.manual_seed(seed); factory()``
    (built on rank 0 only, in host memory; or rank 0's ``full``, built already), persistent
    buffers and non-persistent ones alike."""
    aliases = _aliases(model)
    model.to_empty(device=device)
    _retie(model, aliases)
    rank0 = dist.get_rank() == 0
    if rank0 and full is None:
        torch.manual_seed(seed)
        full = factory()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict  # 0.8 s: FSDP only

    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full.state_dict() if full is not None else {}, options=options)
    _broadcast_other_buffers(model, full, device)


def whole_from_rank0(built: Structure, *, device: torch.device) -> nn.Module:
    """Every rank's copy of rank 0's loaded model (``built.full``; the others materialize the
    structure and receive its tensors): for strategies that replicate whole modules before a
    wrapper (DDP) sees them. Collective."""
    model = built.full if built.full is not None else built.skeleton
    if built.full is None:
        aliases = _aliases(model)
        model.to_empty(device=device)
        _retie(model, aliases)
    model = model.to(device)
    _send_tensors(built.full, _named_tensors(model), device)
    return model


def load_from_rank0(model: nn.Module, full: nn.Module | None, *, device: torch.device,
                    name_of: Callable[[str], str] | None = None) -> None:
    """Give ``model`` (on meta: a pipeline stage or stages, tensor-parallel DTensors, FSDP shards)
    rank 0's ``full`` model's parameters and buffers (persistent or not). ``name_of`` maps a name
    in ``model`` to the whole model's (a stage's blocks are renumbered); a tensor ``model`` does not
    hold is received and dropped. One tensor at a time: no rank holds more than one whole tensor
    beside its own part. Collective (every rank, ``full`` on rank 0 only)."""
    aliases = _aliases(model)
    model.to_empty(device=device)
    _retie(model, aliases)
    rename = name_of or (lambda name: name)
    _send_tensors(full, {rename(name): t for name, t in _named_tensors(model).items()}, device)


def _named_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers (non-persistent ones too) by their clean names (wrappers' prefixes dropped)."""
    return {_clean(name): t for name, t in itertools.chain(model.named_parameters(), model.named_buffers())}


def _send_tensors(full: nn.Module | None, targets: dict[str, torch.Tensor], device: torch.device) -> None:
    """Rank 0's tensors of ``full`` broadcast one by one; each rank copies those ``targets`` names."""
    sources = _named_tensors(full) if full is not None else {}
    box: list[object] = [[(name, tuple(t.shape), t.dtype) for name, t in sources.items()]]
    dist.broadcast_object_list(box, src=0)
    wire = _collective_device(device)
    for name, shape, dtype in box[0]:  # type: ignore[attr-defined]
        staged = sources[name].detach().to(wire) if name in sources else torch.empty(shape, dtype=dtype, device=wire)
        dist.broadcast(staged, src=0)
        target = targets.get(name)
        if target is not None:
            with torch.no_grad():
                _copy_whole(target, staged)


def _copy_whole(target: torch.Tensor, whole: torch.Tensor) -> None:
    """``whole`` into ``target``: itself, or this rank's shard of it when ``target`` is a DTensor
    (cut locally, as the DTensor's placements say: every rank holds the whole tensor already)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(target, DTensor):
        local = distribute_tensor(whole.to(target.device), target.device_mesh, target.placements, src_data_rank=None)
        target.to_local().copy_(local.to_local())
    else:
        target.copy_(whole)


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
