"""Accelerator peak table: dense TFLOP/s per precision and memory, from the vendors' datasheets.

Dense means without 2:4 structured sparsity (datasheets print the sparse figure, twice the
dense one, with an asterisk). ``fp32`` is the plain (non tensor-core) FP32 rate; ``tf32`` is
the tensor-core rate torch uses for fp32 matmuls when ``allow_tf32`` is on. ``None`` marks a
precision the chip has no tensor-core path for (FP8 on A100). Memory is the datasheet
capacity in GB (1e9 bytes), which is a little below the usable GiB figure: a built-in
margin for the CUDA context and the allocator.

This table is shared: the telemetry meter reads it for MFU through :func:`peak_tflops`.
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


def _acc(name: str, memory_gb: float, fp32: float, tf32: float, bf16: float, fp8: float | None,
         source: str) -> Accelerator:
    # fp16 and bf16 run at the same tensor-core rate on every chip listed here
    return Accelerator(name, memory_gb, {"fp32": fp32, "tf32": tf32, "bf16": bf16, "fp16": bf16, "fp8": fp8}, source)


ACCELERATORS: dict[str, Accelerator] = {
    "a100": _acc("A100-SXM4-80GB", 80, 19.5, 156, 312, None, "NVIDIA A100 datasheet (SXM)"),
    "h100-sxm": _acc("H100-SXM5-80GB", 80, 67, 494.7, 989.4, 1978.9, "NVIDIA H100 datasheet (SXM)"),
    "h100-pcie": _acc("H100-PCIe-80GB", 80, 51, 378, 756.5, 1513, "NVIDIA H100 datasheet (PCIe)"),
    "h200": _acc("H200-SXM-141GB", 141, 67, 494.7, 989.4, 1978.9, "NVIDIA H200 datasheet (SXM)"),
    "mi300x": _acc("MI300X-192GB", 192, 163.4, 653.7, 1307.4, 2614.9, "AMD Instinct MI300X datasheet"),
}

ALIASES = {"a100-sxm": "a100", "a100-80gb": "a100", "h100": "h100-sxm", "h200-sxm": "h200"}


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
