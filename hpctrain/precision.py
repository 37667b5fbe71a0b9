"""fp32 / bf16 / fp16 as one object: an autocast context and, for fp16, loss scaling."""

from __future__ import annotations

import contextlib
from typing import Any, Literal

import torch

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_NO_AUTOCAST = contextlib.nullcontext()  # fp32: one shared, reusable context for every micro-step


class Precision:
    """``with precision.autocast(): loss = ...``, then ``precision.backward(loss)`` and
    ``precision.step(optimizer)``. fp16 uses a GradScaler so small gradients do not
    underflow; bf16 has fp32's range and needs none."""

    def __init__(self, mode: str, device: torch.device,
                 scaler: torch.amp.GradScaler | None | Literal["default"] = "default") -> None:
        """``scaler``: the fp16 loss scaler a strategy needs (a ShardedGradScaler where ranks hold
        shards), None for none; by default torch's GradScaler under fp16."""
        if mode not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"precision={mode!r} is not one of fp32, bf16, fp16")
        self.mode, self.device = mode, device
        if scaler == "default":
            scaler = torch.amp.GradScaler(device.type) if mode == "fp16" else None
        self.scaler = scaler

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.mode == "fp32":
            return _NO_AUTOCAST
        return torch.autocast(self.device.type, dtype=_DTYPES[self.mode])

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
