"""fp32 / bf16 / fp16 / fp8 as one object: an autocast context, for fp16 loss scaling, and for
fp8 the model's linear layers swapped for torchao's float8 training layers (:func:`to_float8`).

fp8 is torchao's float8 training (``torchao.float8.convert_to_float8_training``, dynamic
tensorwise scaling): each eligible ``nn.Linear`` runs its three matmuls through
``torch._scaled_mm`` in float8, everything else under bf16 autocast. The float8 matmul exists
on NVIDIA GPUs of compute capability 8.9 and newer; hpctrain asks for 9.0 (Hopper, Blackwell),
where it is faster than bf16, and refuses anything else before the model is built (exit 2)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from hpctrain.core.errors import RunError, UserError
from hpctrain.core.modules import is_dtensor

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


# ---------------------------------------------------------------- non-finite steps


class NonFiniteError(RunError):
    """The run ended on non-finite numerics (train.nonfinite): exit 1, one line."""


def local_max_abs(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """The largest magnitude of this rank's part of ``tensors``, on their device (no host sync):
    nan or inf exactly when one element is. A max, not an L2 norm: huge but finite values do not
    overflow it. DTensors count by their local shard; the caller reduces over ranks."""
    local = [t.to_local() if is_dtensor(t) else t for t in tensors]
    if not local:
        return torch.zeros(())
    # torch's fused per-tensor norms (clip_grad_norm_'s own; get_total_norm's grouping costs 2x on small models)
    with torch.no_grad():  # parameters too (the checkpoint's check): no graph
        norms = torch._foreach_norm(local, math.inf)
    device = norms[0].device
    return torch.stack([n if n.device == device else n.to(device) for n in norms]).max().float()


@dataclass
class NumericsWatch:
    """Judges each optimizer step by its loss and its gradients, before the update.

    The loop hands :meth:`judge` the step's values, already reduced over ranks (so every rank
    decides alike); an update whose values are not finite is never applied. ``policy`` stop ends
    the run at the first such step, skip after ``patience`` in a row. Under fp16 a gradient
    overflow at a loss scale above 1 is the grad scaler's business (it skips the step and halves
    the scale); at a scale of 1 or less the gradients overflow unscaled: a non-finite step."""

    policy: str = "stop"
    patience: int = 3
    nonfinite_steps: int = 0
    skipped_steps: int = 0
    scaler_skipped_steps: int = 0  # fp16 overflows left to the grad scaler (it skips them itself)
    first_step: int | None = None
    in_a_row: int = 0

    def judge(self, step: int, loss: float, grad_max: float, scale: float | None = None, *,
              late: bool = False) -> bool:
        """True: apply step ``step``'s update. False: skip it (counted). NonFiniteError: stop.
        ``late``: judged after its update was applied (:class:`LateRead`; policy stop only)."""
        loss_ok, grads_ok = math.isfinite(loss), math.isfinite(grad_max)
        if loss_ok and grads_ok:
            self.in_a_row = 0
            return True
        if loss_ok and scale is not None and scale > 1.0:
            self.scaler_skipped_steps += 1  # the scaler skips it and tries half the scale next
            return True
        what = describe_nonfinite(loss, grad_max, scale)
        self.nonfinite_steps += 1
        self.in_a_row += 1
        if self.first_step is None:
            self.first_step = step
        if self.policy == "stop" or self.in_a_row >= self.patience:
            raise NonFiniteError(self._stop_message(step, what, scale, late))
        self.skipped_steps += 1
        return False

    def _stop_message(self, step: int, what: str, scale: float | None, late: bool) -> str:
        why = ("train.nonfinite=stop" if self.policy == "stop"
               else f"train.nonfinite=skip: {self.in_a_row} non-finite steps in a row (train.nonfinite_patience="
                    f"{self.patience}; {self.skipped_steps} skipped in all, the first at step {self.first_step})")
        hint = ("hint: precision=bf16 (fp32's range), or a smaller optim.lr" if scale is not None
                else "hint: a smaller optim.lr, train.clip_grad_norm, or train.nonfinite=skip to skip such steps")
        weights = (f"the weights are those after step {step}, read one step late on the GPU" if late
                   else f"the weights are those before step {step}")
        return f"step {step}: {what}; stopped by {why}; {weights}; {hint}"

    def summary(self) -> dict[str, Any]:
        """What summary.json reports."""
        return {"nonfinite_steps": self.nonfinite_steps, "nonfinite_skipped_steps": self.skipped_steps,
                "first_nonfinite_step": self.first_step, "scaler_skipped_steps": self.scaler_skipped_steps}


class LateRead:
    """A step's two checked values, read on the host one step later without waiting for the GPU:
    copied into pinned memory behind an event, which has long completed by the next step (a
    plain ``.tolist()`` would wait for everything queued, and the GPU then idles while the CPU
    queues the update and the next forward). Without CUDA the values are kept as they are."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self._host = [torch.empty(2, pin_memory=True) for _ in range(2)] if cuda else []
        self._events = [torch.cuda.Event() for _ in range(2)] if cuda else []
        self._kept: list[torch.Tensor] = []
        self._turn = 0
        self._pending: tuple[int, int] | None = None  # (step, slot)

    def put(self, step: int, values: torch.Tensor) -> tuple[int, list[float]] | None:
        """Queue step ``step``'s values; returns the previous step's, (step, values), if any."""
        previous = self.take()
        slot, self._turn = self._turn, self._turn ^ 1
        if self.cuda:
            self._host[slot].copy_(values, non_blocking=True)
            self._events[slot].record()
        else:
            self._kept = [values.detach().clone()]
        self._pending = (step, slot)
        return previous

    def take(self) -> tuple[int, list[float]] | None:
        """The values still pending, (step, values), or None."""
        if self._pending is None:
            return None
        (step, slot), self._pending = self._pending, None
        if not self.cuda:
            return step, self._kept[0].tolist()
        self._events[slot].synchronize()
        return step, self._host[slot].tolist()


def describe_nonfinite(loss: float, grad_max: float, scale: float | None) -> str:
    """The values that made a step non-finite, named for the user."""
    parts = []
    if not math.isfinite(loss):
        parts.append(f"the loss is {loss}")
    if not math.isfinite(grad_max):
        parts.append(f"the largest gradient is {grad_max}")
    text = " and ".join(parts)
    if scale is not None:
        text += f" (precision=fp16, loss scale {scale:g}: fp16's range, 65504, is exceeded)"
    return text
