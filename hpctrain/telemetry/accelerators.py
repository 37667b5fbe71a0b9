"""Accelerator peak table: dense TFLOP/s per precision and memory, from the vendors' datasheets.

Dense means without 2:4 structured sparsity (datasheets print the sparse figure, twice the
dense one, with an asterisk). ``fp32`` is the plain (non tensor-core) FP32 rate; ``tf32`` is
the tensor-core rate torch uses for fp32 matmuls when ``allow_tf32`` is on. ``None`` marks a
precision the chip has no tensor-core path for (FP8 on A100; TF32, BF16 and FP8 on V100).
Memory is the datasheet capacity in GB (1e9 bytes), which is a little below the usable GiB
figure: a built-in margin for the CUDA context and the allocator. ``hpctrain estimate
--gpu-memory-gb/--peak-tflops`` override a row for a part the table lacks.

This table is shared: the telemetry meter reads it for MFU through :func:`peak_tflops`, the
estimator and the planner for peaks and memory (a component, so both layers may read it).
"""

from __future__ import annotations

from dataclasses import dataclass

from hpctrain.core.errors import UserError

PRECISIONS = ("fp32", "tf32", "bf16", "fp16", "fp8")


@dataclass(frozen=True)
class Accelerator:
    name: str
    memory_gb: float
    tflops: dict[str, float | None]  # dense peak per precision
    source: str

    def peak_flops(self, precision: str) -> float:
        """Dense peak in FLOP/s; UserError when the chip has no such path."""
        if precision not in self.tflops:
            raise UserError(f"--precision {precision!r} is not one of {', '.join(PRECISIONS)}")
        peak = self.tflops[precision]
        if peak is None:
            have = ", ".join(p for p, v in self.tflops.items() if v is not None)
            raise UserError(f"--precision {precision}: {self.name} has no dense {precision} path; it has: {have}")
        return peak * 1e12

    @property
    def memory_bytes(self) -> float:
        return self.memory_gb * 1e9


def _acc(name: str, memory_gb: float, fp32: float, tf32: float | None, bf16: float | None, fp8: float | None,
         source: str, fp16: float | None = None) -> Accelerator:
    # fp16 runs at the bf16 tensor-core rate on every chip listed here that has bf16 (V100 has fp16 only)
    return Accelerator(name, memory_gb, {"fp32": fp32, "tf32": tf32, "bf16": bf16,
                                         "fp16": bf16 if fp16 is None else fp16, "fp8": fp8}, source)


# Figures are the datasheets' dense ones: where a datasheet prints only the sparse figure (marked *),
# half of it. Keys are matched by prefix elsewhere (planning), so the first entries stay first.
ACCELERATORS: dict[str, Accelerator] = {
    "a100": _acc("A100-SXM4-80GB", 80, 19.5, 156, 312, None, "NVIDIA A100 datasheet (SXM)"),
    "h100-sxm": _acc("H100-SXM5-80GB", 80, 67, 494.7, 989.4, 1978.9, "NVIDIA H100 datasheet (SXM)"),
    "h100-pcie": _acc("H100-PCIe-80GB", 80, 51, 378, 756.5, 1513, "NVIDIA H100 datasheet (PCIe)"),
    "h200": _acc("H200-SXM-141GB", 141, 67, 494.7, 989.4, 1978.9, "NVIDIA H200 datasheet (SXM)"),
    "mi300x": _acc("MI300X-192GB", 192, 163.4, 653.7, 1307.4, 2614.9, "AMD Instinct MI300X datasheet"),
    # A100 datasheet, 40GB SXM column: the 80GB part's rates (FP32 19.5, TF32 312*, BF16 624*), 40 GB HBM2
    "a100-40gb": _acc("A100-SXM4-40GB", 40, 19.5, 156, 312, None, "NVIDIA A100 datasheet (SXM, 40GB)"),
    # V100 datasheet, SXM2: FP32 15.7, Tensor (fp16) 125 TFLOPS, 32 GB HBM2; Volta has no TF32, BF16 or FP8
    "v100": _acc("V100-SXM2-32GB", 32, 15.7, None, None, None, "NVIDIA V100 datasheet (SXM2)", fp16=125),
    # H800 SXM datasheet: the H100 SXM's tensor rates (TF32 989*, BF16 1,979*, FP8 3,958* sparse), FP32 67, 80 GB
    "h800": _acc("H800-SXM5-80GB", 80, 67, 494.7, 989.4, 1978.9, "NVIDIA H800 datasheet (SXM)"),
    # L40S datasheet: FP32 91.6, TF32 183 (366*), BF16/FP16 362.05 (733*), FP8 733 (1,466*), 48 GB GDDR6
    "l40s": _acc("L40S-48GB", 48, 91.6, 183, 362.05, 733, "NVIDIA L40S datasheet"),
    # H100 datasheet, NVL column (per GPU): FP32 60, TF32 835*, BF16 1,671*, FP8 3,341*; 94 GB of its 96 GB HBM3
    "h100-nvl": _acc("H100-NVL-94GB", 94, 60, 417.5, 835.5, 1670.5, "NVIDIA H100 datasheet (NVL)"),
    # HGX B200 datasheet, per GPU: FP32 75, TF32 2.2 PF*, FP16/BF16 4.5 PF*, FP8 9 PF*; 180 GB HBM3e (1.4 TB per 8)
    "b200": _acc("B200-180GB", 180, 75, 1100, 2250, 4500, "NVIDIA HGX B200 datasheet"),
}

ALIASES = {"a100-sxm": "a100", "a100-80gb": "a100", "h100": "h100-sxm", "h200-sxm": "h200", "a100-40": "a100-40gb",
           "v100-sxm2": "v100", "h800-sxm": "h800", "h100-94gb": "h100-nvl", "h100-96gb": "h100-nvl"}


def lookup(name: str) -> Accelerator:
    """An accelerator by key or alias, case-insensitive (``h100`` is the SXM part)."""
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key not in ACCELERATORS:
        raise UserError(f"--gpu {name!r} is not in the peak table; choose one of: {', '.join(ACCELERATORS)} "
                        "(aliases: " + ", ".join(ALIASES) + ")")
    return ACCELERATORS[key]


def peak_tflops(name: str, precision: str) -> float:
    """Dense peak TFLOP/s of ``name`` at ``precision``: the denominator of MFU."""
    return lookup(name).peak_flops(precision) / 1e12
