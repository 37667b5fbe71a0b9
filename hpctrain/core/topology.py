"""The run's topology: how many ranks lie along each parallel dimension, in one object.

:class:`Topology` names every dimension hpctrain knows, outermost first: ``pp`` (pipeline
stages; may cross nodes), ``dp_replicate`` x ``dp_shard`` (data parallelism: HSDP's replicas
and the shards within one; ``dp`` = their product), ``cp`` (context parallel: the sequence
split), ``tp`` (tensor parallel; innermost: neighbouring ranks, the fastest links) and ``ep``
(expert parallel). A dimension a run does not use has size 1. Everything that needs the
layout reads it from here: the config check (:func:`hpctrain.config.parallel.check_topology`),
the run layout (``hpctrain.planning.layout.RunLayout``), the one mesh builder
(``hpctrain.parallel.mesh.build_mesh``, which lays the mesh out as :meth:`Topology.dims` says),
the data-parallel rank and size the loaders see (:meth:`Topology.dp_rank`, :attr:`Topology.dp`)
and the FLOP divisor telemetry uses (:attr:`Topology.flop_divisor`).

Adding a dimension (context parallel, say) is this object plus the strategy that uses it:
give the size a config key that :meth:`Topology.from_config` reads, let :meth:`Topology.dims` place it in the mesh (and
:meth:`Topology.flattened` name any dimension made of several, as ``dp`` is under HSDP), and
say in :attr:`Topology.flop_divisor` / :meth:`Topology.dp_rank` what share of the work a rank
holds. The mesh, the data ranks and telemetry then follow without further edits; the strategy
applies the parallelism on ``mesh[name]``.

Pure arithmetic (no torch): the config check and the estimator use it on a login node. The
object describes any layout (the estimator sizes expert-parallel runs); :meth:`Topology.from_config`,
the config check, refuses what the trainer cannot run yet.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Protocol

from hpctrain.core.section import ConfigError

# Strategies whose data-parallel dimension is replicas (outer) x shards (inner): HSDP.
REPLICATED = ("hsdp",)


class TopologyKeys(Protocol):
    """The ``parallel`` config keys a topology is made from
    (:class:`hpctrain.config.parallel.ParallelConfig` has them)."""

    @property
    def strategy(self) -> str: ...
    @property
    def dp(self) -> int: ...
    @property
    def tp(self) -> int: ...
    @property
    def pp(self) -> int: ...
    @property
    def dp_replicate(self) -> int: ...


@dataclass(frozen=True)
class Topology:
    """Ranks along each parallel dimension (1 = unused). Rank ``r``'s coordinates follow the
    mesh's row-major order (:meth:`dims`): ``tp`` innermost, then ``cp``, ``dp``, ``pp``."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for f in fields(self):
            size = getattr(self, f.name)
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ConfigError(f"topology {f.name}={size!r} must be a positive integer")

    # ---------------------------------------------------------------- sizes

    @property
    def dp(self) -> int:
        """Data-parallel replicas: the ranks that read different batches."""
        return self.dp_replicate * self.dp_shard

    @property
    def world(self) -> int:
        """Ranks in the job. Expert parallelism adds none: its ranks are data-parallel ranks
        (``dp`` splits into ``edp`` x ``ep``; the experts are split over the ep ranks)."""
        return self.pp * self.dp * self.cp * self.tp

    @property
    def dp_cp(self) -> int:
        """The ranks that average the gradients of the weights they all hold: the data-parallel
        replicas and, in each, the context-parallel ranks (which see different tokens of one batch).
        DDP reduces over them; FSDP shards over them (the flattened ``dp_cp`` mesh dim, as torchtitan)."""
        return self.dp * self.cp

    @property
    def model_split(self) -> bool:
        """Is the model (or its sequence) cut over ranks, so that a strategy needs a mesh?"""
        return self.tp > 1 or self.pp > 1 or self.cp > 1

    @property
    def flop_divisor(self) -> int:
        """What telemetry divides the whole model's FLOPs per replica by to get one rank's: a rank
        runs one pipeline stage (1/pp of the blocks), 1/tp of each block's matmuls and 1/cp of
        the sequence; data parallelism divides the batch, which the meter counts per rank already."""
        return self.pp * self.tp * self.cp

    def dp_rank(self, rank: int) -> int:
        """Global ``rank``'s data-parallel replica: its coordinate on the (flattened) ``dp`` dim,
        the rank the data loaders use (the tp, cp ranks and stages of a replica read its batches)."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} outside the topology's world of {self.world}")
        return (rank // (self.cp * self.tp)) % self.dp

    # ---------------------------------------------------------------- the mesh

    def dims(self) -> tuple[tuple[str, int], ...]:
        """The DeviceMesh's dimensions, outermost first: ``pp``, ``dp`` (``dp_replicate``,
        ``dp_shard`` when data parallelism has replicas of shards), ``cp`` when used, ``tp``.
        ``pp``, ``dp`` and ``tp`` are always there (size 1 when unused) so strategies can index them."""
        dp: tuple[tuple[str, int], ...] = (
            (("dp_replicate", self.dp_replicate), ("dp_shard", self.dp_shard)) if self.dp_replicate > 1
            else self._expert_dims() or (("dp", self.dp),))
        cp = (("cp", self.cp),) if self.cp > 1 else ()
        return (("pp", self.pp), *dp, *cp, ("tp", self.tp))

    def names(self) -> tuple[str, ...]:
        """The mesh's dimension names, outermost first (see :meth:`dims`)."""
        return tuple(name for name, _ in self.dims())

    def shape(self) -> tuple[int, ...]:
        return tuple(size for _, size in self.dims())

    def flattened(self) -> dict[str, tuple[str, ...]]:
        """Dimensions made of several of :meth:`dims`: under HSDP, ``dp`` = replicate x shard (the
        loaders' and evaluation's data-parallel group); with context parallel, ``dp_cp`` (HSDP:
        ``dp_shard_cp``), the ranks FSDP shards over (:attr:`dp_cp`)."""
        if self.dp_replicate == 1 and self._expert_dims():
            return {"dp": ("edp", "ep")}
        flat: dict[str, tuple[str, ...]] = {"dp": ("dp_replicate", "dp_shard")} if self.dp_replicate > 1 else {}
        if self.cp > 1:  # FSDP shards over dp x cp (HSDP: replicas of dp_shard x cp)
            flat |= {"dp_shard_cp": ("dp_shard", "cp")} if self.dp_replicate > 1 else {"dp_cp": ("dp", "cp")}
        return flat

    def _expert_dims(self) -> tuple[tuple[str, int], ...]:
        """Expert parallelism splits ``dp`` into ``edp`` (the replicas of one rank's experts,
        outer) x ``ep`` (the ranks that hold different experts, inner; all-to-all among them)."""
        if self.ep == 1 or self.dp % self.ep:
            return ()
        return (("edp", self.dp // self.ep), ("ep", self.ep))

    # ---------------------------------------------------------------- from the config

    @classmethod
    def from_config(cls, cfg: TopologyKeys, world: int, *, num_nodes: int = 1) -> Topology:
        """The topology ``parallel.*`` gives ``world`` ranks (``dp=0``: what tp x pp leave; HSDP's
        ``dp_replicate=0``: one replica per node), or a ConfigError naming the numbers (and for a
        dimension the trainer cannot run yet: ``cp``/``ep`` keys, when a config has them, > 1)."""
        model_parallel = math.prod(getattr(cfg, name, 1) for name in ("tp", "pp", "cp"))
        dp = cfg.dp or world // model_parallel
        if dp * model_parallel != world:
            cp = getattr(cfg, "cp", 1)
            raise ConfigError(f"parallel.dp ({cfg.dp or 'auto'} -> {dp}) x parallel.tp ({cfg.tp}) x parallel.pp "
                              f"({cfg.pp}){f' x parallel.cp ({cp})' if cp > 1 else ''} = {dp * model_parallel} != "
                              f"world size {world}; hint: choose degrees whose product is {world}, or leave "
                              f"parallel.dp=0 and make tp x pp{' x cp' if cp > 1 else ''} divide it")
        replicate = _replicas(cfg, dp, num_nodes)
        topo = cls(pp=cfg.pp, dp_replicate=replicate, dp_shard=dp // replicate, cp=getattr(cfg, "cp", 1), tp=cfg.tp,
                   ep=getattr(cfg, "ep", 1))
        if topo.ep > 1 and (topo.dp_shard % topo.ep or topo.dp_replicate > 1):
            raise ConfigError(f"parallel.ep ({topo.ep}) must divide the data-parallel degree dp ({topo.dp}), without "
                              "HSDP replicas: the experts are split over data-parallel ranks; hint: parallel.ep="
                              f"{math.gcd(topo.ep, topo.dp)}")
        return topo


def _replicas(cfg: TopologyKeys, dp: int, num_nodes: int) -> int:
    if cfg.strategy not in REPLICATED:
        return 1
    replicate = cfg.dp_replicate or num_nodes
    if dp % replicate:
        raise ConfigError(f"parallel.dp_replicate ({cfg.dp_replicate or f'auto = {num_nodes} nodes'}) must divide "
                          f"dp ({dp}) for strategy={cfg.strategy}; hint: set parallel.dp_replicate to a divisor "
                          f"of {dp}")
    return replicate
