"""``parallel.strategy=fsdp parallel.cpu_offload=true``: FSDP2 with parameters, gradients and
optimizer state kept in host memory (torch's ``CPUOffloadPolicy``). Each unit's parameters are
copied to the GPU when gathered for its forward/backward and its gradients copied back; the
optimizer steps on the CPU. For models whose sharded state does not fit the GPU, at the price
of host<->device copies every step. Pinned host memory is used when there is a GPU (the
policy's default fails on a CPU-only machine)."""

from __future__ import annotations

from hpctrain.parallel.fsdp import FSDP


class FSDPOffload(FSDP):
    name = "fsdp_offload"
    offload = True
