"""The strategies ``hpctrain train`` can run, by name: ``parallel.strategy`` (or
:func:`strategy_name`'s ``pipeline`` / ``fsdp_offload``) picks one here. Entries are import paths, resolved only when a
run needs the class, so reading the names (the config check, ``hpctrain config doc``) imports
no torch. A new strategy is one module with a :class:`hpctrain.parallel.base.Strategy`
subclass and one line here (or :func:`register_strategy` from the user's own code)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from hpctrain.config.parallel import STRATEGY_NAMES
from hpctrain.core.section import ConfigError

if TYPE_CHECKING:
    import torch

    from hpctrain.config.parallel import ParallelConfig
    from hpctrain.core.env import ClusterEnv
    from hpctrain.core.topology import Topology
    from hpctrain.parallel.base import Strategy

# parallel.strategy values a user writes
_USER: dict[str, str] = {
    "ddp": "hpctrain.parallel.ddp:DDP",
    "zero1": "hpctrain.parallel.zero:Zero1",
    "fsdp": "hpctrain.parallel.fsdp:FSDP",
    "hsdp": "hpctrain.parallel.fsdp:FSDP",  # FSDP on a (replicate, shard) mesh: the topology's dp_replicate
    "deepspeed": "hpctrain.parallel.deepspeed:DeepSpeed",
}
# chosen by strategy_name from other keys (parallel.pp > 1, parallel.cpu_offload=true)
_DERIVED: dict[str, str] = {
    "pipeline": "hpctrain.parallel.pipeline_strategy:Pipeline",
    "fsdp_offload": "hpctrain.parallel.fsdp_offload:FSDPOffload",
}


def strategy_names() -> tuple[str, ...]:
    """The values ``parallel.strategy`` accepts."""
    return tuple(_USER)


def register_strategy(name: str, target: str, *, user_facing: bool = True) -> None:
    """Make ``parallel.strategy=name`` run the Strategy class at ``package.module:Class``."""
    (_USER if user_facing else _DERIVED)[name] = target
    if user_facing and name not in STRATEGY_NAMES:
        STRATEGY_NAMES.append(name)


def strategy_name(cfg: ParallelConfig) -> str:
    """The registered strategy that runs ``parallel.*``: pipeline stages (around the data-parallel
    strategy of each stage) when ``parallel.pp > 1``, FSDP with CPU offload when asked, else
    ``parallel.strategy`` itself."""
    if cfg.pp > 1:
        return "pipeline"
    if cfg.cpu_offload:
        return "fsdp_offload"
    return cfg.strategy


def strategy_class(name: str) -> type[Strategy]:
    target = _USER.get(name) or _DERIVED.get(name)
    if target is None:
        raise ConfigError(f"parallel.strategy={name!r} is not a registered strategy; choose one of: "
                          f"{', '.join(_USER)}")
    module, _, attr = target.partition(":")
    kind: type[Strategy] = getattr(importlib.import_module(module), attr)
    return kind


def make_strategy(name: str, topology: Topology, env: ClusterEnv, device: torch.device, cfg: ParallelConfig,
                  **options: Any) -> Strategy:
    """The strategy ``name`` for this run on ``topology`` (``options``: the Strategy's keywords,
    e.g. the batch split). One that wraps another (pipeline stages, each run by the data-parallel
    ``parallel.strategy``) is handed that one's class as ``stage``."""
    kind = strategy_class(name)
    if kind.wraps_a_strategy:
        options["stage"] = strategy_class(cfg.strategy)
    return kind(topology, env, device, cfg, **options)
