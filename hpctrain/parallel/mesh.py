"""One DeviceMesh with named dims for every strategy: ``pp`` (outermost, may cross nodes),
``dp`` (or ``dp_replicate`` x ``dp_shard`` for HSDP) and ``tp`` (innermost: neighbouring
ranks, the same node, the fastest links)."""

from __future__ import annotations

from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from hpctrain.core.section import ConfigError


def build_mesh(*, world: int, dp: int, tp: int = 1, pp: int = 1, device_type: str = "cpu",
               dp_replicate: int = 1) -> DeviceMesh:
    """A mesh ``(pp, dp, tp)``, or ``(pp, dp_replicate, dp_shard, tp)`` when ``dp_replicate > 1``;
    under HSDP the flattened ``dp`` dim is there too, for the loader's rank within dp."""
    if dp * tp * pp != world:
        raise ConfigError(f"mesh dp ({dp}) x tp ({tp}) x pp ({pp}) = {dp * tp * pp} != world size {world}")
    if dp_replicate <= 1:
        return init_device_mesh(device_type, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    if dp % dp_replicate:
        raise ConfigError(f"mesh dp_replicate ({dp_replicate}) must divide dp ({dp})")
    mesh = init_device_mesh(device_type, (pp, dp_replicate, dp // dp_replicate, tp),
                            mesh_dim_names=("pp", "dp_replicate", "dp_shard", "tp"))
    mesh["dp_replicate", "dp_shard"]._flatten("dp")
    return mesh


def dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The data-parallel part FSDP shards over: 1D ``dp``, or 2D (replicate, shard) for HSDP."""
    names = mesh.mesh_dim_names or ()
    if "dp_replicate" in names:
        return mesh["dp_replicate", "dp_shard"]
    return mesh["dp"]


def dp_group(mesh: DeviceMesh | None) -> ProcessGroup | None:
    """The process group of this rank's data-parallel replicas (the ``dp`` dim, flattened under
    HSDP): what exact evaluation merges over, each sample once. None without a mesh (one
    process, or data parallel over the whole world: the default group)."""
    if mesh is None:
        return None
    return mesh["dp"].get_group()
