"""What a checkpoint holds, and putting it back.

Replicated state (identical on every DDP rank; rank 0 writes it): model, optimizer, LR
scheduler, GradScaler, counters, best validation so far, the config and its fingerprint.
Per-rank state (every rank writes its own): RNG states (python, numpy, torch CPU, CUDA)
and the training loader's position. Model and optimizer come from the strategy's
:class:`~hpctrain.checkpoint.view.CheckpointView`: whole into the replicated files, or
files of the view's own format, every rank its share.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hpctrain.core.env import ClusterEnv
from hpctrain.core.errors import UserError

log = logging.getLogger("hpctrain")


class CheckpointMismatchError(UserError):
    """The checkpoint to resume holds another model's (or optimizer's) state."""


REPLICATED = "replicated.pt"                   # the state tree, tensors replaced by names
REPLICATED_TENSORS = "replicated.safetensors"  # their bytes (see tensorfile.py)


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


@dataclass
class Snapshot:
    """One rank's share of a checkpoint, as in-memory objects ready to serialize."""

    step: int
    replicated: dict[str, Any] | None   # rank 0 only
    per_rank: dict[str, Any]
    own_state: Any                       # the view's own_state(): what view.write() writes, on every rank
    info: dict[str, Any]                 # goes into the manifest
    view: Any = None                     # the CheckpointView that writes its own files (None: it has none)


# ---------------------------------------------------------------- config fingerprint


def config_fingerprint(cfg_dict: dict[str, Any]) -> str:
    """sha256 of the config without ``resume`` (which legitimately changes on a restart)."""
    payload = {k: v for k, v in cfg_dict.items() if k != "resume"}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def config_changes(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys whose values differ (for a warning on resume), nothing else. A side that
    records no config (a loop that passes none to the Checkpointer) is not a change of every
    key; a section one side lacks counts only its keys whose values differ."""
    if not prefix and not (old and new):
        return []
    changes = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) or isinstance(b, dict):
            changes += config_changes(a if isinstance(a, dict) else {}, b if isinstance(b, dict) else {},
                                      f"{prefix}{key}.")
        elif a != b and key != "resume":
            changes.append(f"{prefix}{key}: {_short(a)} -> {_short(b)}")
    return changes


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."


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


@dataclass
class Counters:
    """Progress that a resumed run must restore (a Stateful; the checkpointer reads ``step``)."""

    step: int = 0          # optimizer steps done
    epoch: int = 0         # epochs completed
    samples_seen: int = 0  # global training samples consumed

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "epoch": self.epoch, "samples_seen": self.samples_seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step, self.epoch, self.samples_seen = state["step"], state["epoch"], state["samples_seen"]


# Entries of the state mapping that differ per rank: each rank writes its own (rank-NNNNN.pt).
PER_RANK = ("loader", "rng")


class RNG:
    """The random streams (python, numpy, torch CPU, CUDA) as a ``Stateful``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def state_dict(self) -> dict[str, Any]:
        return rng_state(self.device)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_rng_state(state, self.device)


def snapshot(state: Mapping[str, Any], env: ClusterEnv, cfg_dict: dict[str, Any],
             best: dict[str, Any]) -> Snapshot:
    """References to the live state (no copies): a sync save serializes them right away,
    an async save stages them first (see writer.Stager). ``state``: Stateful objects by name;
    ``state["model"]`` is the strategy's :class:`~hpctrain.checkpoint.view.CheckpointView` of
    model + optimizer (its format is the manifest's), ``state["counters"]`` has the ``step``."""
    view = state["model"]
    counters = state["counters"].state_dict()
    per_rank = {"rank": env.rank, "world_size": env.world_size, "counters": counters,
                **{name: state[name].state_dict() for name in PER_RANK if state.get(name) is not None}}
    # every rank, every format: buffers made rank 0's (one consistent copy; a sharded save would otherwise
    # write each replicated buffer from whichever rank it balances the load to), a split optimizer consolidated
    view.gather()
    own_state = view.own_state()
    replicated = None
    if env.is_main:
        replicated = {name: (obj.state_dict() if obj is not None else None) for name, obj in state.items()
                      if name != "model" and name not in PER_RANK}
        replicated.update({"best": dict(best), "config": cfg_dict, "config_sha256": config_fingerprint(cfg_dict)})
        replicated.update(view.whole_state())
    info = {**counters, "world_size": env.world_size, "format": view.format,
            "config_sha256": config_fingerprint(cfg_dict)}
    info.update(view.manifest_info())
    return Snapshot(counters["step"], replicated, per_rank, own_state, info, view if view.files_dir else None)


def restore(state: Mapping[str, Any], replicated: dict[str, Any], per_rank: dict[str, Any], env: ClusterEnv,
            cfg_dict: dict[str, Any], source: Any = None) -> dict[str, Any]:
    """Put a checkpoint back into ``state``, all but model + optimizer (the view's ``load`` put
    them back); returns the saved ``best`` record.

    ``per_rank`` is this rank's file, or rank 0's when the world size changed: then the
    loader gets rank 0's position (a resharding loader can map it) and RNG keeps seed + rank.
    """
    for name, obj in state.items():
        if obj is None or name == "model":
            continue
        if name in PER_RANK:  # what this checkpoint holds (a hand-made snapshot may leave some out)
            if name in per_rank and (name != "rng" or per_rank["world_size"] == env.world_size):
                obj.load_state_dict(per_rank[name])
        elif replicated.get(name) is not None:
            obj.load_state_dict(replicated[name])
    changes = config_changes(replicated.get("config", {}), cfg_dict)
    if changes and env.is_main:
        more = f"; and {len(changes) - 8} more" if len(changes) > 8 else ""
        log.warning("resuming with a changed config (the run may not match an uninterrupted one): %s%s",
                    "; ".join(changes[:8]), more)
    if per_rank["world_size"] != env.world_size and env.is_main:
        log.warning("resuming at world size %d from a checkpoint of world size %d: model and optimizer are "
                    "exact, RNG streams restart from seed + data-parallel rank", env.world_size, per_rank["world_size"])
    return dict(replicated.get("best") or {})
