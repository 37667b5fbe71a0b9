"""The machine a plan is for: one rank's memory budget, a nominal compute rate and link bandwidths.

Two sources, and the planner never mixes them:

- a named target (``parallel.target_gpu``, ``hpctrain plan --gpu``): a row of the accelerator
  table (:mod:`hpctrain.telemetry.accelerators`), its datasheet memory unless
  ``parallel.memory_budget_gb`` says otherwise and its dense peak unless
  ``parallel.target_peak_tflops`` does. Nothing is asked of the local device (a login node, a GPU
  node: the same machine, so the same plan) and no torch is loaded;
- otherwise the device the trainer finds at run time: the CUDA device's reported memory and name,
  or on a CPU rank ``parallel.memory_budget_gb`` (required there).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from hpctrain.core.errors import UserError
from hpctrain.core.section import ConfigError
from hpctrain.planning.links import Links, links_for
from hpctrain.telemetry.accelerators import ACCELERATORS, lookup

if TYPE_CHECKING:
    from hpctrain.config import Config
    from hpctrain.core.env import ClusterEnv

UTILISATION = 0.4  # of the dense peak: the estimator's default MFU, the rate candidates are ranked at
CPU_LINKS = (2e9, 2e9)  # gloo on a CPU
CPU_FLOPS = 50e9  # a CPU rank's nominal rate
UNKNOWN_GPU_FLOPS = 100e12  # a GPU the table does not know (40% of a nominal 250 TFLOP/s)


@dataclass(frozen=True)
class Machine:
    """What one rank has: memory budget, a nominal compute rate and link bandwidths (bytes/s)."""

    kind: str  # cuda | cpu
    name: str
    budget: float  # bytes
    usable: float  # bytes: budget less the margin
    flops: float  # sustained FLOP/s assumed
    intra: float
    inter: float
    local: int  # ranks per node: data parallelism within them uses the fast link
    target: str | None = None  # parallel.target_gpu when the machine was named, not detected
    intra_name: str = ""  # the node's GPU link, in words ("NVLink 4 (450 GB/s ...)", "PCIe 4.0 x16 ...")
    network_name: str = ""  # where the network figure came from

    @property
    def pcie(self) -> bool:
        """The node's GPUs talk over PCIe: tensor parallelism there is the last resort."""
        return self.intra_name.startswith("PCIe")

    @property
    def attention(self) -> str:
        """The attention kernel the target runs (the memory declaration's term): the models call
        SDPA, whose CUDA kernels (flash, memory-efficient) and CPU flash kernel keep no s x s
        scores for backward (only the meta device's math path does, which the planner never uses
        for a declared model)."""
        return "flash"


def detect_machine(cfg: Config, env: ClusterEnv, network_gbps: float | None = None) -> Machine:
    """The named target (``parallel.target_gpu``), else this rank's device; ``network_gbps`` (Gb/s per
    GPU between nodes, ``hpctrain plan --network-gbps``; a config's ``parallel.network_gbps`` where it
    has one) over the GPU family's default network."""
    network = network_gbps if network_gbps is not None else getattr(cfg.parallel, "network_gbps", None)
    if cfg.parallel.target_gpu is not None:
        return target_machine(cfg, env, network)
    return _local_machine(cfg, env, network)


def _with_links(machine: Machine, links: Links) -> Machine:
    return replace(machine, intra=links.intra, inter=links.inter, intra_name=links.intra_name,
                   network_name=f"{links.network_gbps:g} Gb/s per GPU ({links.network_name})")


def _key(name: str) -> str | None:
    """The accelerator-table key of a part named by key, alias or device name."""
    try:
        gpu = lookup(name)
    except UserError:
        lowered = name.lower()
        return next((k for k in ACCELERATORS if k.split("-")[0] in lowered), None)
    return next(k for k, v in ACCELERATORS.items() if v is gpu)


def target_machine(cfg: Config, env: ClusterEnv, network_gbps: float | None = None) -> Machine:
    """``parallel.target_gpu`` from the accelerator table; ConfigError for a name it lacks (unless
    both ``parallel.memory_budget_gb`` and ``parallel.target_peak_tflops`` describe the part)."""
    p = cfg.parallel
    assert p.target_gpu is not None
    described = p.memory_budget_gb is not None and p.target_peak_tflops is not None
    try:
        gpu = lookup(p.target_gpu)
    except UserError:
        if not described:
            raise ConfigError(f"parallel.target_gpu={p.target_gpu!r} is not in the accelerator table; choose one of: "
                              f"{', '.join(ACCELERATORS)}; hint: or describe it with parallel.memory_budget_gb and "
                              "parallel.target_peak_tflops (hpctrain plan --gpu-memory-gb, --peak-tflops)") from None
        name, budget, peak = p.target_gpu, 0.0, 0.0
    else:
        _check_precision(gpu.name, gpu.tflops, cfg.precision, p.target_peak_tflops)
        name, budget, peak = gpu.name, gpu.memory_bytes, _table_peak(gpu.tflops, cfg.precision)
    budget = p.memory_budget_gb * 1e9 if p.memory_budget_gb is not None else budget
    peak = p.target_peak_tflops * 1e12 if p.target_peak_tflops is not None else peak
    flops = UTILISATION * peak if peak else UNKNOWN_GPU_FLOPS
    links = links_for(_key(p.target_gpu), network_gbps)
    return _with_links(Machine("cuda", name, budget, budget * (1 - p.memory_margin), flops, 0.0, 0.0,
                               env.local_world_size, target=p.target_gpu), links)


def _check_precision(name: str, tflops: dict[str, float | None], precision: str, given: float | None) -> None:
    """fp8 on a GPU without fp8 matmuls (A100, V100, ...) is refused, as ``hpctrain estimate`` refuses
    it: the plan would rank candidates at a rate the chip cannot run. A peak given for the part
    (``parallel.target_peak_tflops``) is the user's word that it has one."""
    if precision == "fp8" and tflops.get("fp8") is None and given is None:
        have = ", ".join(k for k, v in tflops.items() if v is not None)
        raise ConfigError(f"precision=fp8: {name} has no fp8 matmuls (it has: {have}); hint: precision=bf16, or a "
                          "GPU with fp8 (h100-sxm, h200, b200, mi300x, l40s)")


def _table_peak(tflops: dict[str, float | None], precision: str) -> float:
    """The table's dense peak (FLOP/s) for the run's precision: fp8 runs bf16 outside its matmuls,
    so bf16 is taken for it too; 0 where the chip has no such path (bf16 on a V100)."""
    peak = tflops.get(precision if precision in ("bf16", "fp16") else "bf16" if precision == "fp8" else "fp32")
    return 0.0 if peak is None else peak * 1e12


def _local_machine(cfg: Config, env: ClusterEnv, network_gbps: float | None = None) -> Machine:
    """The budget (``parallel.memory_budget_gb``, else the GPU's total memory) and nominal rates."""
    import torch  # torch: only when the machine is this rank's own device

    budget_gb = cfg.parallel.memory_budget_gb
    margin = 1 - cfg.parallel.memory_margin
    if torch.cuda.is_available():  # the trainer's device
        index = env.local_rank % torch.cuda.device_count()
        props = torch.cuda.get_device_properties(index)
        budget = budget_gb * 1e9 if budget_gb is not None else float(props.total_memory)
        machine = Machine("cuda", props.name, budget, budget * margin, _gpu_flops(props.name, cfg.precision),
                          0.0, 0.0, env.local_world_size)
        return _with_links(machine, links_for(_key(props.name), network_gbps))
    if budget_gb is None:
        raise ConfigError("parallel.strategy=auto on CPU needs parallel.memory_budget_gb (the memory one rank may "
                          "use, in GB); hint: parallel.memory_budget_gb=8, or plan for a GPU with "
                          "parallel.target_gpu=NAME (hpctrain plan --gpu NAME)")
    return Machine("cpu", "cpu", budget_gb * 1e9, budget_gb * 1e9 * margin, CPU_FLOPS, *CPU_LINKS,
                   env.local_world_size)


def _gpu_flops(name: str, precision: str) -> float:
    """40% of the table's dense peak for a GPU it knows by its device name, else 100 TFLOP/s."""
    key = next((k for k in ACCELERATORS if k.split("-")[0] in name.lower()), None)
    if key is None:
        return UNKNOWN_GPU_FLOPS
    peak = _table_peak(ACCELERATORS[key].tflops, precision)
    return UTILISATION * peak if peak else UNKNOWN_GPU_FLOPS
