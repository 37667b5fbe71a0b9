"""Utilisation, power and temperature of this rank's NVIDIA GPU through NVML (``nvidia-ml-py``).

Optional: without the package, without NVML (no driver, an AMD GPU) or on CPU the meter
simply logs no ``gpu_*`` columns. NVML reads the driver's counters; it never touches the
CUDA stream, so sampling it once per logged row costs microseconds and syncs nothing.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

import torch

log = logging.getLogger("hpctrain")


class GpuMonitor:
    """``sample()`` -> {gpu_util, gpu_mem_util, gpu_power_w, gpu_temp_c} for one device."""

    def __init__(self, nvml: Any, handle: Any) -> None:
        self._nvml, self._handle = nvml, handle

    @classmethod
    def open(cls, device: torch.device) -> GpuMonitor | None:
        """A monitor for ``device``, or None where NVML is not available."""
        if device.type != "cuda":
            return None
        try:
            nvml = importlib.import_module("pynvml")  # the `nvidia-ml-py` package
            nvml.nvmlInit()
            return cls(nvml, _handle(nvml, device))
        except Exception as err:  # noqa: BLE001 - no package, no driver, not NVIDIA: just no gpu_* columns
            log.debug("NVML not available (%s): no GPU utilisation/power/temperature columns", err)
            return None

    def sample(self) -> dict[str, float]:
        try:
            util = self._nvml.nvmlDeviceGetUtilizationRates(self._handle)
            power_mw = self._nvml.nvmlDeviceGetPowerUsage(self._handle)
            temp = self._nvml.nvmlDeviceGetTemperature(self._handle, self._nvml.NVML_TEMPERATURE_GPU)
        except Exception as err:  # noqa: BLE001 - a counter the GPU lacks must not stop training
            log.debug("NVML sample failed: %s", err)
            return {}
        return {"gpu_util": float(util.gpu) / 100, "gpu_mem_util": float(util.memory) / 100,
                "gpu_power_w": power_mw / 1000, "gpu_temp_c": float(temp)}


def _handle(nvml: Any, device: torch.device) -> Any:
    """NVML numbers GPUs physically, CUDA after CUDA_VISIBLE_DEVICES: match them by UUID."""
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    if uuid is not None:
        text = str(uuid)
        return nvml.nvmlDeviceGetHandleByUUID(text if text.startswith("GPU-") else f"GPU-{text}")
    return nvml.nvmlDeviceGetHandleByIndex(device.index or 0)
