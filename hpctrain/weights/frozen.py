"""Fine-tuning on a frozen base (LoRA through PEFT, or any model with parameters frozen by
``requires_grad_(False)``): checkpoints hold only what trains.

A model with frozen parameters is saved without them: the trained parameters, the buffers and
the optimizer state (which holds only the trained parameters anyway). The frozen base comes
back from the model's own construction (``from_pretrained``), so a checkpoint of LoRA on an 8B
base is tens of MB instead of 16 GB. What makes that safe is the *base record* saved beside the
tensors: the sha256 of the frozen parameters (sorted-name order, whole tensors, whatever the
layout: :class:`~hpctrain.weights.digest.ParamsHash`), their count, and for a PEFT model each
adapter's ``adapter_config.json`` with the map from checkpoint names to PEFT's file names
(computed by PEFT's own ``get_peft_model_state_dict``). A resume, ``hpctrain eval`` and
``hpctrain ckpt export --merged`` check the base they were given against the digest and refuse
another one (:class:`BaseMismatchError`, exit 2).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hpctrain.checkpoint import layout
from hpctrain.core.errors import UserError
from hpctrain.core.modules import is_dtensor, unwrap
from hpctrain.weights.digest import ParamsHash, clean_name

RECORD = "frozen_base"  # the replicated state's entry (and the manifest's field, where the manifest carries it)


class BaseMismatchError(UserError):
    """The frozen base given is not the one the checkpoint's adapters were trained on."""


def frozen_names(model: nn.Module) -> list[str]:
    """Clean names of the frozen parameters (shared ones once), sorted."""
    return sorted(clean_name(n) for n, p in unwrap(model).named_parameters() if not p.requires_grad)


def has_frozen_base(model: nn.Module) -> bool:
    """Some parameters frozen and some trained: the checkpoints hold the trained ones only."""
    flags = {p.requires_grad for p in unwrap(model).parameters()}
    return flags == {True, False}


def trained_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` without the frozen parameters (a tied frozen weight under each of
    its names): the trained parameters and the buffers, references, no copies."""
    return {name: value.detach() for name, value in unwrap(model).state_dict(keep_vars=True).items()
            if not (isinstance(value, nn.Parameter) and not value.requires_grad)}


def base_digest(model: nn.Module, names: list[str] | None = None) -> str:
    """sha256 of the frozen parameters' whole tensors (``names``: these instead), in sorted-name
    order. A sharded parameter (DTensor) is gathered one at a time: every rank calls it."""
    params = {clean_name(n): p for n, p in unwrap(model).named_parameters()}
    wanted = sorted(names if names is not None else frozen_names(model))
    missing = [n for n in wanted if n not in params]
    if missing:
        raise BaseMismatchError(f"the model has no parameter {missing[0]!r} of the frozen base ({len(missing)} "
                                "missing); hint: build the model the checkpoint was trained with")
    digest = ParamsHash(wanted)
    for name in wanted:
        digest.update(name, _whole(params[name].detach()))
    return digest.hexdigest()


def _whole(value: torch.Tensor) -> torch.Tensor:
    if is_dtensor(value):
        mesh = value.device_mesh.device_type  # type: ignore[attr-defined]
        on_mesh: Any = value.to(mesh) if value.device.type != mesh else value
        return on_mesh.full_tensor()
    return value


def base_record(model: nn.Module) -> dict[str, Any]:
    """The record saved with a frozen-base checkpoint (plain data: strings and numbers)."""
    names = frozen_names(model)
    record: dict[str, Any] = {"sha256": base_digest(model, names), "parameters": len(names),
                              "numel": sum(p.numel() for p in unwrap(model).parameters() if not p.requires_grad)}
    adapters = peft_adapters(model)
    if adapters:
        record["adapters"] = adapters
    return record


def peft_adapters(model: nn.Module) -> dict[str, Any]:
    """A PEFT model's adapters: for each, its ``adapter_config.json`` text and PEFT's file names of
    the checkpoint's tensors (``{checkpoint name: adapter_model.safetensors name}``); {} otherwise."""
    inner = unwrap(model)
    configs = getattr(inner, "peft_config", None)
    if not isinstance(configs, dict) or not configs:
        return {}
    from peft.utils import get_peft_model_state_dict  # a PEFT model: peft is installed

    state = trained_state(inner)
    by_id = {id(tensor): clean_name(name) for name, tensor in state.items()}
    out = {}
    for adapter, config in configs.items():
        renamed = get_peft_model_state_dict(inner, state_dict=state, adapter_name=adapter)
        files = {by_id[id(t)]: name for name, t in renamed.items() if id(t) in by_id}
        out[adapter] = {"config": _config_json(config), "files": files}
    return out


def _config_json(config: Any) -> str:
    """PEFT's ``adapter_config.json`` as ``save_pretrained`` writes it (sets become lists)."""
    data = config.to_dict()
    return json.dumps({k: sorted(v) if isinstance(v, set) else v for k, v in data.items()}, indent=2, sort_keys=True)


# ---------------------------------------------------------------- loading


def check_base(model: nn.Module, record: dict[str, Any] | None, source: Any, digest: str | None = None,
               also: str = "") -> None:
    """Refuse a checkpoint's trained tensors on another base than theirs (exit 2). ``record``
    None: a whole checkpoint (it holds the base itself). ``digest``: the live base's, when the
    caller computed it already (a collective under FSDP); ``also``: the hint's end."""
    if record is None:
        return
    got = digest if digest is not None else base_digest(model)
    if got != record.get("sha256"):
        count = record.get("parameters", "?")
        raise BaseMismatchError(
            f"checkpoint {source} was trained on another frozen base: its {count} frozen parameters had sha256 "
            f"{str(record.get('sha256'))[:16]}..., this model's {len(frozen_names(model))} have {got[:16]}...; hint: "
            f"build the model on the base the run was trained on (the same model.name, from_pretrained path and "
            f"seed){also}")


def missing_ok(model: nn.Module, missing: list[str], unexpected: list[str], record: dict[str, Any] | None,
               source: Any) -> None:
    """After ``load_state_dict(strict=False)``: a frozen-base checkpoint may lack exactly the
    frozen parameters (and their tied names), nothing else; a whole one may lack nothing."""
    allowed = set(frozen_state_names(model)) if record is not None else set()
    extra = sorted(set(missing) - allowed)
    if extra or unexpected:
        what = f"missing {', '.join(extra[:3])}" if extra else f"unexpected {', '.join(sorted(unexpected)[:3])}"
        raise RuntimeError(f"Error(s) in loading state_dict for the model of {source}: {what}")


def frozen_state_names(model: nn.Module) -> list[str]:
    """State-dict names of the frozen parameters (each name of a tied one)."""
    return [clean_name(name) for name, value in unwrap(model).state_dict(keep_vars=True).items()
            if isinstance(value, nn.Parameter) and not value.requires_grad]


def load_trained(model: nn.Module, state: dict[str, torch.Tensor], record: dict[str, Any] | None,
                 source: Any) -> None:
    """A checkpoint's model tensors into ``model`` (one process: eval, export): the whole model,
    or a frozen-base checkpoint's trained tensors onto this model's base once its digest matched."""
    if record is not None and not has_frozen_base(model):
        raise BaseMismatchError(f"checkpoint {source} holds only the trained parameters of a frozen base (LoRA), but "
                                "this model freezes none; hint: build the model as the run did (its PEFT wrapping)")
    check_base(model, record, source)
    result = unwrap(model).load_state_dict(state, strict=False)
    missing_ok(model, list(result.missing_keys), list(result.unexpected_keys), record, source)


def read_base_record(path: Path) -> dict[str, Any] | None:
    """The base record of the committed checkpoint at ``path`` (None: a whole checkpoint):
    the manifest's field, else the replicated state's entry (its small skeleton, checked as a
    resume checks it)."""
    manifest = layout.read_manifest(path)
    if isinstance(manifest.get(RECORD), dict):
        return dict(manifest[RECORD])
    # torch: only for a checkpoint whose manifest lacks the record (the skeleton's weights-only load)
    from hpctrain.checkpoint.checkpointer import load_file
    from hpctrain.checkpoint.state import REPLICATED

    if REPLICATED not in manifest["files"]:
        return None
    skeleton = load_file(path / REPLICATED, manifest["files"])
    record = skeleton.get(RECORD) if isinstance(skeleton, dict) else None
    return dict(record) if isinstance(record, dict) else None


def adapter_tensors(names: dict[str, str], tensors: Iterator[tuple[str, torch.Tensor | None]]) \
        -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's ``(name, tensor)`` pairs that are one adapter's, under PEFT's file names."""
    for name, tensor in tensors:
        if name in names and tensor is not None:
            yield names[name], tensor
