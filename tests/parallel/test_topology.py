"""The one topology object (hpctrain.core.topology.Topology): every strategy layout gives the sizes,
data-parallel ranks and FLOP divisor the run used before it (the old Plan's ``(rank // tp) % dp``,
``pp x tp``), the one mesh builder lays 4 gloo ranks out with the same dim names and coordinates,
the run layout carries it, and bad sizes (and the dimensions not implemented yet) are a ConfigError."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from hpctrain.config import load_config
from hpctrain.config.parallel import ParallelConfig, check_topology
from hpctrain.core.env import ClusterEnv
from hpctrain.core.section import ConfigError
from hpctrain.core.topology import Topology
from hpctrain.planning.layout import make_layout
from tests.dist_utils import run_ranks

# name -> (parallel.* keys, world, nodes, (pp, dp_replicate, dp_shard, tp), mesh dims, each rank's dp rank,
#          FLOP divisor)
LAYOUTS: dict[str, tuple[dict[str, Any], int, int, tuple[int, int, int, int], tuple[tuple[str, int], ...],
                         list[int], int]] = {
    "ddp": ({}, 4, 1, (1, 1, 4, 1), (("pp", 1), ("dp", 4), ("tp", 1)), [0, 1, 2, 3], 1),
    "zero1": ({"strategy": "zero1"}, 4, 1, (1, 1, 4, 1), (("pp", 1), ("dp", 4), ("tp", 1)), [0, 1, 2, 3], 1),
    "fsdp": ({"strategy": "fsdp"}, 4, 1, (1, 1, 4, 1), (("pp", 1), ("dp", 4), ("tp", 1)), [0, 1, 2, 3], 1),
    "hsdp 2x2": ({"strategy": "hsdp"}, 4, 2, (1, 2, 2, 1),
                 (("pp", 1), ("dp_replicate", 2), ("dp_shard", 2), ("tp", 1)), [0, 1, 2, 3], 1),
    "tp2": ({"tp": 2}, 2, 1, (1, 1, 1, 2), (("pp", 1), ("dp", 1), ("tp", 2)), [0, 0], 2),
    "pp2": ({"pp": 2}, 2, 1, (2, 1, 1, 1), (("pp", 2), ("dp", 1), ("tp", 1)), [0, 0], 2),
    "dp2xtp2": ({"strategy": "fsdp", "tp": 2}, 4, 1, (1, 1, 2, 2), (("pp", 1), ("dp", 2), ("tp", 2)), [0, 0, 1, 1], 2),
    "pp2xdp2": ({"strategy": "fsdp", "pp": 2}, 4, 1, (2, 1, 2, 1), (("pp", 2), ("dp", 2), ("tp", 1)), [0, 1, 0, 1], 2),
    "pp2xdp2xtp2": ({"strategy": "fsdp", "pp": 2, "tp": 2}, 8, 1, (2, 1, 2, 2), (("pp", 2), ("dp", 2), ("tp", 2)),
                    [0, 0, 1, 1, 0, 0, 1, 1], 4),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_each_layout_gives_the_sizes_and_ranks_it_ran_with(name: str) -> None:
    keys, world, nodes, (pp, rep, shard, tp), dims, dp_ranks, divisor = LAYOUTS[name]
    topo = check_topology(ParallelConfig(**keys), world, num_nodes=nodes)
    assert topo == Topology(pp=pp, dp_replicate=rep, dp_shard=shard, tp=tp)
    assert topo == Topology.from_config(ParallelConfig(**keys), world, num_nodes=nodes)
    assert (topo.world, topo.dp, topo.cp, topo.ep) == (world, rep * shard, 1, 1)
    assert topo.dims() == dims and topo.names() == tuple(n for n, _ in dims)
    assert topo.shape() == tuple(s for _, s in dims)
    assert [topo.dp_rank(r) for r in range(world)] == dp_ranks
    assert [topo.dp_rank(r) for r in range(world)] == [(r // tp) % topo.dp for r in range(world)]  # the old Plan's
    assert topo.flop_divisor == divisor == pp * tp
    assert topo.model_split == (tp > 1 or pp > 1)
    assert topo.flattened() == ({"dp": ("dp_replicate", "dp_shard")} if rep > 1 else {})


def test_hsdp_replicas_from_the_key_or_the_nodes() -> None:
    assert check_topology(ParallelConfig(strategy="hsdp", dp_replicate=4), 8).dp_shard == 2
    assert check_topology(ParallelConfig(strategy="hsdp"), 8, num_nodes=2) == Topology(dp_replicate=2, dp_shard=4)
    assert check_topology(ParallelConfig(strategy="fsdp"), 8, num_nodes=2) == Topology(dp_shard=8)  # no replicas


def test_the_run_layout_holds_the_topology_and_the_data_view() -> None:
    cfg = load_config(None, ["model.name=gpt", "model.n_layers=2", "model.hidden=32", "model.heads=4",
                             "parallel.strategy=fsdp", "parallel.tp=2", "data.batch_size=2", "train.grad_accum=3"])
    envs = [ClusterEnv(rank=r, local_rank=r, world_size=4, local_world_size=4) for r in range(4)]
    layouts = [make_layout(cfg, env)[1] for env in envs]
    assert {layout.topology for layout in layouts} == {Topology(dp_shard=2, tp=2)}
    assert [(lay.strategy, lay.dp, lay.dp_rank, lay.global_batch, lay.flops_divisor) for lay in layouts] == \
        [("fsdp", 2, dp, 2 * 3 * 2, 2) for dp in (0, 0, 1, 1)]
    assert [(e.rank, e.world_size) for e in (lay.data_env(env) for lay, env in zip(layouts, envs))] == \
        [(0, 2), (0, 2), (1, 2), (1, 2)]


@pytest.mark.parametrize("sizes, text", [
    ({"tp": 0}, "topology tp=0 must be a positive integer"),
    ({"dp_shard": -1}, "topology dp_shard=-1 must be a positive integer"),
    ({"pp": True}, "topology pp=True must be a positive integer"),
])
def test_bad_sizes_are_a_config_error(sizes: dict[str, Any], text: str) -> None:
    with pytest.raises(ConfigError, match=text):
        Topology(**sizes)


def test_context_parallel_is_a_dimension_of_the_mesh() -> None:
    """parallel.cp (issue 28): the cp ranks sit between dp and tp, read their replica's batches,
    and FSDP shards over dp x cp (the flattened dp_cp dim; HSDP: dp_shard_cp)."""
    keys = SimpleNamespace(strategy="fsdp", dp=0, tp=2, pp=1, dp_replicate=0, cp=2)
    layout = Topology.from_config(keys, 8)
    assert (layout.dp, layout.cp, layout.dp_cp, layout.world) == (2, 2, 4, 8)
    assert layout.dims() == (("pp", 1), ("dp", 2), ("cp", 2), ("tp", 2))
    assert [layout.dp_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert layout.flattened() == {"dp_cp": ("dp", "cp")}
    assert Topology(dp_replicate=2, dp_shard=2, cp=2).flattened() == {"dp": ("dp_replicate", "dp_shard"),
                                                                     "dp_shard_cp": ("dp_shard", "cp")}


def test_a_world_the_config_does_not_fill_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"parallel\.dp \(3 -> 3\) x parallel\.tp \(2\) x parallel\.pp \(1\) = 6 "
                                          r"!= world size 4"):
        Topology.from_config(ParallelConfig(strategy="fsdp", dp=3, tp=2), 4)
    with pytest.raises(ConfigError, match=r"parallel\.dp_replicate \(3\) must divide dp \(4\) for strategy=hsdp"):
        Topology.from_config(ParallelConfig(strategy="hsdp", dp_replicate=3), 4)
    with pytest.raises(ValueError, match="rank 4 outside the topology's world of 4"):
        Topology(dp_shard=4).dp_rank(4)
    with pytest.raises(ConfigError, match=r"x parallel\.cp \(2\) = 8 != world size 4"):
        Topology.from_config(load_config(None, ["parallel.cp=2", "parallel.dp=4"]).parallel, 4)


# ---------------------------------------------------------------- the mesh, on 4 gloo ranks

MESHES = ("fsdp", "hsdp 2x2", "dp2xtp2", "pp2xdp2")


def _meshes(env: ClusterEnv) -> dict[str, Any]:
    """Per layout: the mesh's dim names and sizes and this rank's coordinates on pp, dp, tp; then
    which strategies build a mesh at plain data parallelism (FSDP shards over it, DDP needs none)."""
    import torch

    from hpctrain.parallel import strategy_for
    from hpctrain.parallel.mesh import build_mesh

    out: dict[str, Any] = {}
    for name in MESHES:
        keys, world, nodes, *_ = LAYOUTS[name]
        mesh = build_mesh(check_topology(ParallelConfig(**keys), world, num_nodes=nodes), torch.device("cpu"))
        out[name] = (mesh.mesh_dim_names, tuple(mesh.mesh.shape),
                     tuple(mesh[dim].get_local_rank() for dim in ("pp", "dp", "tp")))
    for strategy in ("ddp", "fsdp"):
        made = strategy_for(ParallelConfig(strategy=strategy), env, torch.device("cpu"))
        out[f"strategy={strategy}"] = None if made.mesh is None else made.mesh.mesh_dim_names
    torch.distributed.barrier()  # no rank ends the group while another still joins the last mesh's groups
    return out


def test_one_mesh_builder_lays_out_every_layout() -> None:
    ranks = run_ranks(4, _meshes)
    for rank, got in enumerate(ranks):
        for name in MESHES:
            _, _, _, (pp, rep, shard, tp), dims, dp_ranks, _ = LAYOUTS[name]
            assert got[name] == (tuple(n for n, _ in dims), tuple(s for _, s in dims),
                                 (rank // (rep * shard * tp), dp_ranks[rank], rank % tp)), (name, rank)
        assert (got["strategy=ddp"], got["strategy=fsdp"]) == (None, ("pp", "dp", "tp"))
