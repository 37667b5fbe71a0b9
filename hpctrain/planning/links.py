"""The links of a GPU machine as they are: per GPU its link to the GPUs of its node (an NVLink
generation, or PCIe when the part has none) and per node its network, in bytes/s one way per GPU,
what a ring collective moves at. Datasheet figures (NVIDIA's "GPU-to-GPU bandwidth" is both
directions summed: halved here); the network is the common build of each family's nodes (one
400 Gb/s NIC per H100/H200/B200, 200 Gb/s per A100 as in DGX A100, PCIe servers of L40S or H100
PCIe with fewer, slower NICs), which ``hpctrain plan --network-gbps`` replaces. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpctrain.estimate import bounds


@dataclass(frozen=True)
class Links:
    intra: float  # bytes/s one way per GPU to the others of its node
    intra_name: str  # "NVLink 4 (450 GB/s)", "PCIe 4.0 x16 (32 GB/s)"
    network_gbps: float  # Gb/s per GPU between nodes
    network_name: str = ""  # where the network figure came from

    @property
    def inter(self) -> float:
        """Bytes/s per GPU between nodes."""
        return self.network_gbps * 1e9 / 8

    @property
    def pcie(self) -> bool:
        """The GPUs of a node talk over PCIe (no NVLink): tensor parallelism is slow there."""
        return self.intra_name.startswith("PCIe")


def _nvlink(generation: int, bidirectional_gbs: float) -> tuple[float, str]:
    return bidirectional_gbs / 2 * 1e9, f"NVLink {generation} ({bidirectional_gbs / 2:g} GB/s per GPU each way)"


def _pcie(generation: int, gbs: float) -> tuple[float, str]:
    return gbs * 1e9, f"PCIe {generation}.0 x16 ({gbs:g} GB/s each way)"


# accelerator-table key -> (intra-node link, default network Gb/s per GPU, its source)
TABLE: dict[str, tuple[tuple[float, str], float, str]] = {
    "a100": (_nvlink(3, 600), 200, "DGX A100: 8 x 200 Gb/s HDR InfiniBand for 8 GPUs"),
    "a100-40gb": (_nvlink(3, 600), 200, "DGX A100: 8 x 200 Gb/s HDR InfiniBand for 8 GPUs"),
    "h100-sxm": (_nvlink(4, 900), 400, "DGX H100: 8 x 400 Gb/s ConnectX-7 for 8 GPUs"),
    "h200": (_nvlink(4, 900), 400, "DGX H200: 8 x 400 Gb/s ConnectX-7 for 8 GPUs"),
    "h800": (_nvlink(4, 400), 400, "DeepSeek-V3's H800 nodes: 8 x 400 Gb/s InfiniBand for 8 GPUs"),
    "b200": (_nvlink(5, 1800), 400, "DGX B200: 8 x 400 Gb/s ConnectX-7 for 8 GPUs"),
    "v100": (_nvlink(2, 300), 100, "DGX-2: 8 x 100 Gb/s EDR for 16 GPUs, taken as 100 per GPU"),
    "mi300x": ((448e9, "Infinity Fabric (7 x 64 GB/s per GPU each way)"), 400,
               "8 x 400 Gb/s for 8 GPUs (AMD Instinct MI300X platform)"),
    "h100-pcie": (_pcie(5, 64), 200, "a PCIe server: 4 x 400 Gb/s for 8 GPUs"),
    "h100-nvl": (_pcie(5, 64), 200, "a PCIe server (the NVLink bridge joins pairs only): 4 x 400 Gb/s for 8 GPUs"),
    "l40s": (_pcie(4, 32), 100, "a PCIe server: 4 x 200 Gb/s for 8 GPUs"),
}
UNKNOWN = (_nvlink(3, 600), 100.0, "a GPU the link table lacks: NVLink 3 and 100 Gb/s assumed")


def links_for(key: str | None, network_gbps: float | None = None) -> Links:
    """The links of the accelerator-table part ``key`` (None, or a part the table lacks: the
    defaults), with ``network_gbps`` (Gb/s per GPU) over the family's network."""
    (intra, name), network, source = TABLE.get((key or "").lower(), UNKNOWN)
    if network_gbps is not None:
        bounds.check_number("--network-gbps", network_gbps, 1e6)
        return Links(intra, name, network_gbps, "--network-gbps")
    return Links(intra, name, network, source)

