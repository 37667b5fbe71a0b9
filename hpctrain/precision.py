"""fp32 / bf16 / fp16 / fp8 as one object: an autocast context, for fp16 loss scaling, and for
fp8 the model's linear layers swapped for torchao's float8 training layers (:func:`to_float8`).

fp8 is torchao's float8 training (``torchao.float8.convert_to_float8_training``, dynamic
tensorwise scaling): each eligible ``nn.Linear`` runs its three matmuls through
``torch._scaled_mm`` in float8, everything else under bf16 autocast. The float8 matmul exists
on NVIDIA GPUs of compute capability 8.9 and newer; hpctrain asks for 9.0 (Hopper, Blackwell),
where it is faster than bf16, and refuses anything else before the model is built (exit 2)."""

from __future__ import annotations

import contextlib
from typing import Any, Literal

import torch
from torch import nn

from hpctrain.errors import UserError

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}  # fp8: bf16 outside the linears
MODES = ("fp32", "bf16", "fp16", "fp8")
FP8_CAPABILITY = (9, 0)  # Hopper and newer
# The output projection stays in bf16, as torchao and torchtitan recommend: its gradient is the
# loss's, the most sensitive to float8's 3-bit mantissa.
FP8_SKIP = ("head", "lm_head", "output")
_NO_AUTOCAST = contextlib.nullcontext()  # fp32: one shared, reusable context for every micro-step


class Precision:
    """``with precision.autocast(): loss = ...``, then ``precision.backward(loss)`` and
    ``precision.step(optimizer)``. fp16 uses a GradScaler so small gradients do not
    underflow; bf16 has fp32's range and needs none."""

    def __init__(self, mode: str, device: torch.device,
                 scaler: torch.amp.GradScaler | None | Literal["default"] = "default") -> None:
        """``scaler``: the fp16 loss scaler a strategy needs (a ShardedGradScaler where ranks hold
        shards), None for none; by default torch's GradScaler under fp16."""
        if mode not in MODES:
            raise ValueError(f"precision={mode!r} is not one of {', '.join(MODES)}")
        if mode == "fp8":
            check_fp8(device)
        self.mode, self.device = mode, device
        if scaler == "default":
            scaler = torch.amp.GradScaler(device.type) if mode == "fp16" else None
        self.scaler = scaler

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.mode == "fp32":
            return _NO_AUTOCAST
        return torch.autocast(self.device.type, dtype=_DTYPES[self.mode])

    def convert(self, model: nn.Module) -> nn.Module:
        """The model as this precision trains it: fp8 swaps its linear layers (:func:`to_float8`),
        before tensor parallelism, compile and data parallelism wrap it; others leave it as it is."""
        return to_float8(model) if self.mode == "fp8" else model

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Before clipping: bring fp16-scaled gradients back to their true size."""
        if self.scaler:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler:
            self.scaler.step(optimizer)  # skips the step when gradients overflowed
            self.scaler.update()
        else:
            optimizer.step()

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler and state:
            self.scaler.load_state_dict(state)


def check_fp8(device: torch.device) -> None:
    """UserError (exit 2) unless ``device`` can train in float8 and torchao imports."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < FP8_CAPABILITY:
        need = ".".join(map(str, FP8_CAPABILITY))
        raise UserError(f"precision=fp8 needs an NVIDIA GPU of compute capability {need} or newer (Hopper, "
                        f"Blackwell) for torchao's float8 training; this run's device is "
                        f"{device_name(device)}; hint: precision=bf16")
    _import_torchao()


def device_name(device: torch.device) -> str:
    if device.type != "cuda":
        return f"{device.type} (no CUDA GPU)"
    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor})"


def _import_torchao() -> Any:
    try:
        import torchao.float8  # optional: the mfu extra
    except ImportError as err:
        raise UserError(f"precision=fp8 trains through torchao's float8 layers, which do not import ({err}); "
                        "hint: pip install torchao (keeping your torch), or precision=bf16") from None
    return torchao.float8


def fp8_eligible(module: nn.Module, fqn: str) -> bool:
    """A linear layer float8 can run: both sizes multiples of 16 (``torch._scaled_mm``'s rule)
    and not the output projection (:data:`FP8_SKIP`)."""
    if not isinstance(module, nn.Linear) or fqn.rsplit(".", 1)[-1] in FP8_SKIP:
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def to_float8(model: nn.Module) -> nn.Module:
    """``model`` with each :func:`fp8_eligible` ``nn.Linear`` replaced in place by torchao's
    ``Float8Linear`` (same parameters and state-dict keys, so checkpoints and export are unchanged)."""
    float8 = _import_torchao()
    return float8.convert_to_float8_training(model, module_filter_fn=fp8_eligible)  # type: ignore[no-any-return]
