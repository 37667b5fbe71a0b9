"""The one DeviceMesh builder: every strategy's mesh is :func:`build_mesh` of the run's
:class:`~hpctrain.core.topology.Topology`, with the dimensions the topology names, outermost
first: ``pp`` (may cross nodes), ``dp`` (or ``dp_replicate`` x ``dp_shard`` for HSDP, with the
flattened ``dp`` too), ``tp`` (innermost: neighbouring ranks, the same node, the fastest links).
A new dimension changes the topology, not this module."""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from hpctrain.core.topology import Topology


def build_mesh(topology: Topology, device: torch.device | str = "cpu") -> DeviceMesh:
    """The mesh :meth:`Topology.dims` lays out over the world's ranks on ``device``'s type, with
    each of :meth:`Topology.flattened`'s dimensions (HSDP's ``dp``) flattened from its parts."""
    device_type = device.type if isinstance(device, torch.device) else device
    mesh = init_device_mesh(device_type, topology.shape(), mesh_dim_names=topology.names())
    for name, parts in topology.flattened().items():
        mesh[parts]._flatten(name)
    return mesh


def dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The data-parallel part FSDP shards over: 1D ``dp``, or 2D (replicate, shard) for HSDP; with
    context parallel the shard dim takes in the cp ranks (``dp_cp``, HSDP's ``dp_shard_cp``: the
    flattened dims :meth:`~hpctrain.core.topology.Topology.flattened` names), as torchtitan."""
    names = mesh.mesh_dim_names or ()
    cp = "cp" in names
    if "dp_replicate" in names:
        return mesh["dp_replicate", "dp_shard_cp" if cp else "dp_shard"]
    return mesh["dp_cp" if cp else "dp"]


def dp_group(mesh: DeviceMesh | None) -> ProcessGroup | None:
    """The process group of this rank's data-parallel replicas (the ``dp`` dim, flattened under
    HSDP): what exact evaluation merges over, each sample once. None without a mesh (one
    process, or data parallel over the whole world: the default group)."""
    if mesh is None:
        return None
    return mesh["dp"].get_group()
