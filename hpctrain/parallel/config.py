"""The ``parallel`` config section: the data-parallel strategy and its process group."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hpctrain.section import opt, positive


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    strategy: Literal["ddp"] = opt("ddp", "Data-parallel strategy (ddp; FSDP/ZeRO arrive with the sharded-training issue).")
    backend: Literal["auto", "nccl", "gloo"] = opt("auto", "Process-group backend; auto = nccl with CUDA, else gloo.")
    init_timeout_s: float = opt(600.0, "Seconds to wait for all ranks in init_process_group and collectives.")
    bucket_cap_mb: float = opt(25.0, "DDP gradient bucket size in MiB.")
    gradient_as_bucket_view: bool = opt(True, "DDP: gradients are views into buckets (saves a copy and memory).")
    static_graph: bool = opt(False, "DDP: the graph is the same every step (enables extra optimizations).")
    find_unused_parameters: bool = opt(False, "DDP: search for parameters that get no gradient (slower).")
    broadcast_buffers: bool = opt(True, "DDP: broadcast buffers (e.g. BatchNorm stats) from rank 0 each forward.")

    def __post_init__(self) -> None:
        positive("parallel", self, "init_timeout_s", "bucket_cap_mb")
