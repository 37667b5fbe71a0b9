"""What a checkpoint holds, and putting it back.

Replicated state (identical on every DDP rank; rank 0 writes it): model, optimizer, LR
scheduler, GradScaler, counters, best validation so far, the config and its fingerprint.
Per-rank state (every rank writes its own): RNG states (python, numpy, torch CPU, CUDA)
and the training loader's position. With ``checkpoint.format=dcp`` model and optimizer
go through torch.distributed.checkpoint instead, every rank writing its own shard.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hpctrain.env import ClusterEnv
from hpctrain.errors import UserError

log = logging.getLogger("hpctrain")


class CheckpointMismatchError(UserError):
    """The checkpoint to resume holds another model's (or optimizer's) state."""


REPLICATED = "replicated.pt"                   # the state tree, tensors replaced by names
REPLICATED_TENSORS = "replicated.safetensors"  # their bytes (see tensorfile.py)
SHARDED_DIR = "sharded"
DEEPSPEED_DIR = "deepspeed"  # format=deepspeed: DeepSpeed's own checkpoint files (engine.save_checkpoint)


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


@dataclass
class Snapshot:
    """One rank's share of a checkpoint, as in-memory objects ready to serialize."""

    step: int
    replicated: dict[str, Any] | None   # rank 0 only
    per_rank: dict[str, Any]
    sharded: dict[str, Any] | None      # format=dcp: model + optimizer, on every rank
    info: dict[str, Any]                 # goes into the manifest
    engine: Any = None                   # format=deepspeed: the engine, whose own save writes model + optimizer


# ---------------------------------------------------------------- config fingerprint


def config_fingerprint(cfg_dict: dict[str, Any]) -> str:
    """sha256 of the config without ``resume`` (which legitimately changes on a restart)."""
    payload = {k: v for k, v in cfg_dict.items() if k != "resume"}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def config_changes(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys whose values differ (for a warning on resume)."""
    changes = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            changes += config_changes(a, b, f"{prefix}{key}.")
        elif a != b and key != "resume":
            changes.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return changes


# ---------------------------------------------------------------- RNG


def rng_state(device: torch.device) -> dict[str, Any]:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()  # type: ignore[misc]
    state: dict[str, Any] = {
        "python": random.getstate(),
        # Plain lists keep the file loadable with torch.load(weights_only=True).
        "numpy": [kind, np.asarray(keys).tolist(), int(pos), int(has_gauss), float(gauss)],
        "torch": torch.get_rng_state(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    random.setstate(_as_tuples(state["python"]))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _as_tuples(value: Any) -> Any:
    # random.setstate wants tuples; serialization may hand back lists.
    return tuple(_as_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


# ---------------------------------------------------------------- collect / restore


def snapshot(parts: Any, env: ClusterEnv, device: torch.device, cfg_dict: dict[str, Any],
             best: dict[str, Any], fmt: str) -> Snapshot:
    """References to the live state (no copies): a sync save serializes them right away,
    an async save stages them first (see writer.Stager). ``fmt``: torch (rank 0 writes model and
    optimizer whole), dcp (every rank its shards), deepspeed (DeepSpeed's save, every rank)."""
    from hpctrain.parallel import unwrap

    counters = parts.counters.state_dict()
    per_rank = {"rank": env.rank, "world_size": env.world_size, "rng": rng_state(device),
                "loader": parts.train_loader.state_dict(), "counters": counters}
    sharded = _sharded_state(parts) if fmt == "dcp" else None
    if fmt == "torch" and env.distributed:
        _consolidate_zero1(parts.optimizer)
    replicated = None
    if env.is_main:
        replicated = {
            "scheduler": parts.scheduler.state_dict() if parts.scheduler is not None else None,
            "scaler": parts.precision.state_dict(), "counters": counters, "best": dict(best),
            "config": cfg_dict, "config_sha256": config_fingerprint(cfg_dict),
        }
        if fmt == "torch":
            replicated["model"] = unwrap(parts.model).state_dict()
            replicated["optimizer"] = parts.optimizer.state_dict()
    info = {**counters, "world_size": env.world_size, "format": fmt, "config_sha256": config_fingerprint(cfg_dict)}
    engine = getattr(parts.step, "engine", None) if fmt == "deepspeed" else None
    return Snapshot(counters["step"], replicated, per_rank, sharded, info, engine)


def _consolidate_zero1(optimizer: Any) -> None:
    """ZeRO-1 (strategy=zero1) splits the optimizer state over the ranks: every rank sends its
    part to rank 0, whose ``state_dict()`` is then the whole state (a one-process optimizer's
    layout, so a resume at any world size, or into ddp, loads it; ZeRO-1 re-splits it on load)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if isinstance(optimizer, ZeroRedundancyOptimizer):
        optimizer.consolidate_state_dict(to=0)  # a collective: every rank, before rank 0's state_dict()


def _sharded_state(parts: Any) -> dict[str, Any]:
    """format=dcp: model and optimizer under the whole model's parameter names (a pipeline
    stage's blocks renumbered), the optimizer flattened to one entry per name, so that any
    split of the model (fsdp at any world size, any pp x dp, one process) reads its own names."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from hpctrain.parallel.pipeline import PipelineStep
    from hpctrain.parallel.pipeline_state import FLAT, pipeline_state

    if isinstance(getattr(parts, "step", None), PipelineStep):
        return pipeline_state(parts.step, parts.optimizer)
    model_sd, optim_sd = get_state_dict(parts.model, parts.optimizer, options=FLAT)
    return {"model": model_sd, "optimizer": optim_sd}


def restore(parts: Any, replicated: dict[str, Any], per_rank: dict[str, Any], env: ClusterEnv,
            device: torch.device, cfg_dict: dict[str, Any], source: Any = None) -> dict[str, Any]:
    """Put a checkpoint back into ``parts``; returns the saved ``best`` record.

    ``per_rank`` is this rank's file, or rank 0's when the world size changed: then the
    loader gets rank 0's position (a resharding loader can map it) and RNG keeps seed + rank.
    """
    from hpctrain.parallel import unwrap

    if "model" in replicated:
        try:
            unwrap(parts.model).load_state_dict(replicated["model"])
            parts.optimizer.load_state_dict(replicated["optimizer"])
        except (RuntimeError, ValueError, KeyError) as err:  # another model's checkpoint: bad input, not a bug
            raise CheckpointMismatchError(
                f"checkpoint {source} does not fit this model ({' '.join(str(err).split())[:300]}); hint: "
                "resume with the model.name and model.num_classes that wrote it, or resume=never") from err
    if parts.scheduler is not None and replicated.get("scheduler") is not None:
        parts.scheduler.load_state_dict(replicated["scheduler"])
    parts.precision.load_state_dict(replicated.get("scaler") or {})
    parts.counters.load_state_dict(replicated["counters"])
    changes = config_changes(replicated.get("config", {}), cfg_dict)
    if changes and env.is_main:
        log.warning("resuming with a changed config (the run may not match an uninterrupted one): %s",
                    "; ".join(changes))
    parts.train_loader.load_state_dict(per_rank["loader"])
    if per_rank["world_size"] == env.world_size:
        set_rng_state(per_rank["rng"], device)
    elif env.is_main:
        log.warning("resuming at world size %d from a checkpoint of world size %d: model and optimizer are "
                    "exact, RNG streams restart from seed + data-parallel rank", env.world_size, per_rank["world_size"])
    return dict(replicated.get("best") or {})


def restore_sharded(parts: Any, path: Any, group: Any) -> None:
    """format=dcp: every rank reads its shard (the world size, and the pipeline split, may differ
    from the save's). Checkpoints written before the optimizer was saved flattened load too."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    from hpctrain.parallel.pipeline import PipelineStep
    from hpctrain.parallel.pipeline_state import load_pipeline_state

    flat = _optimizer_flattened(path)
    if isinstance(getattr(parts, "step", None), PipelineStep):
        if not flat:
            raise CheckpointMismatchError(f"checkpoint {path} holds the optimizer in the older nested layout, which "
                                          "pipeline stages cannot split; hint: resume it without parallel.pp")
        load_pipeline_state(parts.step, parts.optimizer, str(path), group)
        return
    options = StateDictOptions(flatten_optimizer_state_dict=flat)
    model_sd, optim_sd = get_state_dict(parts.model, parts.optimizer, options=options)
    state = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(state, checkpoint_id=str(path), process_group=group)
    set_state_dict(parts.model, parts.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd,
                   options=options)


def _optimizer_flattened(path: Any) -> bool:
    """Did the save flatten the optimizer (``optimizer.param_groups.<name>.<key>`` entries)?"""
    import torch.distributed.checkpoint as dcp

    names = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return any(name.startswith("optimizer.param_groups.") for name in names)
