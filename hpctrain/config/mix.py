"""``data.mix``: a weighted mixture of data sources, as the config holds it.

Torch-free and checked when the config loads, so a bad entry exits 2 before any rank starts.
Each entry is a mapping: ``name`` and/or ``path`` (any ``data.name`` / ``data.path`` form; a
``path`` alone means ``name: shards``), ``weight`` (>= 0; the shares are the weights over their
sum; 0: validated, never trained on), an optional ``label`` (how logs and metrics name the
source), and any other ``data`` key for this source alone (``max_train_samples``, ``shuffle``,
``val_split``, ``stage_dir``, ...). The keys that shape the mixture's batches stay the run's.
At most ``MAX_SOURCES`` (1024) entries; a weight is a finite number >= 0, their sum finite and
> 0, and each positive weight at least ``MIN_SHARE`` (1e-6) of the sum.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from hpctrain.core.section import ConfigError

# the mixture's loader owns these: one batch shape and one DataLoader for all sources
RUN_ONLY = ("mix", "batch_size", "global_batch_size", "eval_batch_size", "num_workers", "prefetch_factor",
            "pin_memory", "persistent_workers", "drop_last")
ENTRY_ONLY = ("weight", "label")
MIN_SHARE = 1e-6  # a positive weight below this share of the total would round to nothing
# The shares are whole parts of 2^20 (hpctrain.data.mixture.QUANTUM), the largest source absorbing
# the rounding (at most half a part per source): up to 1024 sources, equal ones get >= 1024 parts
# each and rounding takes at most 512 from the largest, so no share can round to nothing or below.
MAX_SOURCES = 1024
HINT = "hint: data.mix='[{name: mnist, weight: 3}, {path: /data/web, weight: 1}]'"


@dataclass(frozen=True)
class MixEntry:
    """One source of the mixture: ``options`` are its ``data`` keys (name and path included)."""

    index: int
    label: str
    weight: float
    options: dict[str, Any]

    @property
    def key(self) -> str:
        """How messages name the entry."""
        return f"data.mix[{self.index}] ({self.label})"


def check_mix(data: Any) -> None:
    """Refuse a bad ``data.mix`` of a ``DataConfig`` (any error: one line naming the key)."""
    if data.mix is not None:
        mix_entries(data.mix, [f.name for f in dataclasses.fields(data)])


def mix_entries(mix: list[dict[str, Any]], data_keys: list[str]) -> list[MixEntry]:
    """The checked entries of ``data.mix``; ``data_keys``: the ``data`` section's keys."""
    if not mix:
        raise ConfigError(f"data.mix is an empty list; give at least one source, or leave it unset; {HINT}")
    if len(mix) > MAX_SOURCES:
        raise ConfigError(f"data.mix has {len(mix)} sources; at most {MAX_SOURCES} are supported (each share is a "
                          "whole part of 2^20); hint: combine small sources into one (their shards in one data.path)")
    allowed = sorted(set(data_keys) - set(RUN_ONLY)) + list(ENTRY_ONLY)
    entries = [_entry(i, raw, allowed) for i, raw in enumerate(mix)]
    total = sum(e.weight for e in entries)
    if not math.isfinite(total):
        raise ConfigError(f"data.mix: the weights sum to more than a float holds ({total:g}); hint: scale them "
                          "down: only their ratios count")
    if total <= 0:
        raise ConfigError(f"data.mix: the weights sum to {total:g}; at least one must be > 0; {HINT}")
    for e in entries:
        if 0 < e.weight < MIN_SHARE * total:
            raise ConfigError(f"data.mix[{e.index}].weight={e.weight:g} is below {MIN_SHARE:g} of the total "
                              f"({total:g}); hint: raise it, or 0 to validate on the source without training on it")
    return _unique_labels(entries)


def _entry(index: int, raw: Any, allowed: list[str]) -> MixEntry:
    where = f"data.mix[{index}]"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}={raw!r} must be a mapping with name or path, and weight; {HINT}")
    unknown = sorted(set(raw) - set(allowed))
    if unknown:
        raise ConfigError(f"unknown key '{where}.{unknown[0]}'; valid keys: {', '.join(allowed)} (the run's "
                          f"{', '.join(RUN_ONLY[1:])} apply to every source)")
    if not raw.get("name") and not raw.get("path"):
        raise ConfigError(f"{where} names no source; hint: give name: NAME (any data.name) or path: DIR "
                          "(tar shards, local or a URL)")
    weight = raw.get("weight")
    if weight is None:
        raise ConfigError(f"{where} has no weight; hint: add weight: W (the share is W over the sum of the weights)")
    if isinstance(weight, int) and not isinstance(weight, bool) and abs(weight) > 2**1000:
        # past a float (math.isfinite would raise), and too long to print: its digits counted
        raise ConfigError(f"{where}.weight (an integer of {math.floor(math.log10(abs(weight))) + 1} digits) is "
                          "too large for a float; hint: scale the weights down: only their ratios count")
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight < 0:
        raise ConfigError(f"{where}.weight={weight!r} must be a number >= 0 and finite; hint: the share of a source is "
                          "its weight over the sum of the weights")
    options = {k: v for k, v in raw.items() if k not in ENTRY_ONLY}
    if not options.get("name"):
        options["name"] = "shards"  # a path alone: tar shards there
    label = raw.get("label") or _label_of(options)
    if not isinstance(label, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", label):
        raise ConfigError(f"{where}.label={label!r} must be letters, digits, '_', '.' or '-' (it names metrics)")
    return MixEntry(index, label, float(weight), options)


def _label_of(options: dict[str, Any]) -> str:
    """A source's name in logs and metrics: the last part of its path, or its data.name."""
    name = str(options["name"])
    where = options.get("path") or (name.partition(":")[2] if ":" in name and "/" in name else "")
    text = PurePosixPath(str(where).rstrip("/")).stem if where else name.rpartition(":")[2] or name
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "source"


def _unique_labels(entries: list[MixEntry]) -> list[MixEntry]:
    """Two sources with one label: the later ones get their index appended."""
    seen: set[str] = set()
    out = []
    for e in entries:
        label = e.label if e.label not in seen else f"{e.label}_{e.index}"
        seen.add(label)
        out.append(dataclasses.replace(e, label=label))
    return out


def data_text(data: Any) -> str:
    """How logs and summaries name a run's data: ``data.name``, or the mixture's labels and weights."""
    if data.mix is None:
        return str(data.name)
    entries = mix_entries(data.mix, [f.name for f in dataclasses.fields(data)])
    return "mix(" + ", ".join(f"{e.label}={e.weight:g}" for e in entries) + ")"
