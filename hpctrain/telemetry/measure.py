"""The one measurement of an ``nn.Module``: the FLOPs of its forward and backward
(``torch.utils.flop_counter``), the bytes autograd saves for backward (saved-tensor hooks) and
the elements and bytes of its parameters and buffers.

The estimator (``hpctrain estimate --model``), the planner (``parallel.strategy=auto``) and a
run's telemetry (MFU, ``memory_breakdown``) all count with these functions, by the same rules, so
their numbers agree. A model built on the meta device (:func:`on_meta`) is measured without memory
or compute, whatever its size; real tensors are measured by the same rules during training.

It lives in ``telemetry`` (a component, the package that measures a run) rather than in
``estimate`` or ``parallel``: those are higher layers that use it, and it needs nothing of
theirs (no strategy, no planner, no model registry).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils.flop_counter import FlopCounterMode

from hpctrain.core.modules import local_part

StorageKey = tuple[str, int]


def on_meta(factory: Callable[[], nn.Module]) -> nn.Module:
    """The model's structure without memory for its weights."""
    with torch.device("meta"):
        return factory()


# ---------------------------------------------------------------- parameters and buffers


def param_count(modules: Iterable[nn.Module]) -> int:
    """Elements of the distinct parameters of ``modules`` (a weight tied between two of them once)."""
    seen = {id(p): p.numel() for m in modules for p in m.parameters()}
    return sum(seen.values())


def param_bytes(model: nn.Module) -> int:
    """Bytes of the model's distinct parameters, at their own dtype (meta tensors too: what they would hold)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def buffer_bytes(model: nn.Module) -> int:
    """Bytes of the model's distinct buffers (persistent or not), at their own dtype."""
    return sum(b.numel() * b.element_size() for b in model.buffers())


# ---------------------------------------------------------------- FLOPs


@dataclass(frozen=True)
class Flops:
    """FLOPs counted over one call: the total, and by module path (a module's count includes its
    children's, as ``FlopCounterMode.get_flop_counts`` reports them; ``"Global"`` is everything)."""

    total: int
    by_module: dict[str, int]


def count_flops(run: Callable[[], object]) -> Flops:
    """FLOPs of whatever ``run()`` computes: matmuls, convolutions and attention, 2 per multiply-add;
    elementwise ops, norms and softmax are not counted (PyTorch's counter and the MFU convention)."""
    with FlopCounterMode(display=False) as counter:
        run()
    by_module = {name: int(sum(ops.values())) for name, ops in counter.get_flop_counts().items()}
    return Flops(int(counter.get_total_flops()), by_module)


def train_flops(model: nn.Module, x: torch.Tensor) -> Flops:
    """FLOPs of one forward and backward of ``model`` on ``x`` (backward of the output's sum: the
    loss adds no counted FLOPs)."""
    return count_flops(lambda: model(x).float().sum().backward())


def counted_per_sample(model: nn.Module, sample_shape: tuple[int, ...], batch: int = 2,
                       dtype: torch.dtype = torch.float32) -> float:
    """Forward+backward FLOPs per sample of a meta-device model (measured at ``batch`` samples:
    a batch norm needs more than one)."""
    x = torch.empty((batch, *sample_shape), dtype=dtype, device="meta")
    return train_flops(model, x).total / batch


# ---------------------------------------------------------------- what a rank holds of a tensor


def _owner(tensor: torch.Tensor) -> torch.Tensor | None:
    """The tensor whose storage holds ``tensor``'s memory: a DTensor's local shard; for a wrapper
    subclass without storage of its own (a not-yet-waited collective's result), its inner tensor."""
    local = local_part(tensor)
    if is_traceable_wrapper_subclass(local):
        inner = local.__tensor_flatten__()[0]
        return _owner(getattr(local, inner[0])) if inner else None
    return local


def storage_key(tensor: torch.Tensor) -> StorageKey | None:
    """Which storage holds the tensor (None: none, e.g. freed). Every view and alias of a tensor
    shares its storage, so this is the one identity under which memory is counted.

    Real tensors are told apart by their address. Meta tensors have no address (all 0), but a view
    or alias of a meta tensor shares its storage object as on a real device, so they are told apart
    by that object: the meta count then follows the same aliasing as memory does, where a tensor's
    Python identity (views counted again) or its ``_base`` (aliases such as ``detach()`` counted
    again) would not."""
    owner = _owner(tensor)
    if owner is None:
        return None
    storage = owner.untyped_storage()
    if not storage.nbytes():
        return None
    device = owner.device
    return str(device), (storage._cdata if device.type == "meta" else storage.data_ptr())


def storage_bytes(tensor: torch.Tensor, element_bytes: int | None = None) -> int:
    """Bytes of the storage that holds ``tensor``, whole (what memory keeps alive while any view of
    it is held). ``element_bytes``: count a floating storage at that element size instead, the way
    autocast would compute it, but never above its own (autocast only lowers precision: a bf16
    tensor stays 2 bytes under an fp32 count)."""
    owner = _owner(tensor)
    if owner is None:
        return 0
    nbytes = owner.untyped_storage().nbytes()
    if element_bytes is None or not owner.is_floating_point():
        return nbytes
    size = owner.element_size()
    return nbytes // size * min(element_bytes, size)


# ---------------------------------------------------------------- bytes saved for backward


def _is_parameter(tensor: torch.Tensor) -> bool:
    """A parameter or a view of one (``weight.t()`` saved by a matmul; FSDP's gathered ones)."""
    current: torch.Tensor | None = tensor
    while current is not None:
        if isinstance(current, nn.Parameter):
            return True
        current = current._base
    return False


class SavedTensorMeter:
    """Live and peak bytes of the distinct storages autograd holds for backward (a context
    manager; the hooks are thread-local: enter it on the thread that runs the forward).

    The rule, the same on real and meta tensors: each storage counts once, whole, while anything
    saved holds it (:func:`storage_key`, :func:`storage_bytes`); parameters (and views of them,
    and the storages in ``exclude``) are not activations. ``element_bytes`` counts floating
    storages at that size (see :func:`storage_bytes`; None: their own); ``on_new(nbytes)`` is
    called as a storage starts to be held, to attribute it (the planner: to a piece of the model).
    ``real_only``: a real step's count, where tensors on the meta device (a pipeline schedule's
    shape inference) hold no memory and are left out.
    """

    def __init__(self, exclude: set[StorageKey] | None = None, *, element_bytes: int | None = None,
                 on_new: Callable[[int], None] | None = None, real_only: bool = False) -> None:
        self.exclude = exclude or set()
        self.element_bytes = element_bytes
        self.real_only = real_only
        self.live = self.peak = 0
        self._on_new = on_new
        self._refs: dict[StorageKey, tuple[int, int]] = {}  # storage -> (holders, bytes)
        self._lock = threading.Lock()  # releases may come from autograd's backward threads
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def __enter__(self) -> SavedTensorMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)

    def _pack(self, tensor: torch.Tensor) -> Any:
        if self.real_only and tensor.device.type == "meta":
            return tensor
        key = storage_key(tensor)
        if key is None or key in self.exclude or _is_parameter(tensor):
            return tensor
        with self._lock:
            holders, nbytes = self._refs.get(key, (0, 0))
            if holders == 0:
                nbytes = storage_bytes(tensor, self.element_bytes)
                self.live += nbytes
                self.peak = max(self.peak, self.live)
                if self._on_new is not None:
                    self._on_new(nbytes)
            self._refs[key] = (holders + 1, nbytes)
        return _Saved(self, key, tensor)

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Saved) else packed

    def release(self, key: StorageKey) -> None:
        with self._lock:
            holders, nbytes = self._refs[key]
            if holders > 1:
                self._refs[key] = (holders - 1, nbytes)
            else:
                del self._refs[key]
                self.live -= nbytes


class _Saved:
    """What autograd keeps instead of the tensor; autograd drops it once backward used it."""

    __slots__ = ("meter", "key", "tensor")

    def __init__(self, meter: SavedTensorMeter, key: StorageKey, tensor: torch.Tensor) -> None:
        self.meter, self.key, self.tensor = meter, key, tensor

    def __del__(self) -> None:
        self.meter.release(self.key)


def parameter_storages(model: nn.Module) -> set[StorageKey]:
    """The storages of the model's parameters: what a saved-tensor count leaves out."""
    return {k for k in map(storage_key, model.parameters()) if k is not None}


def saved_tensor_bytes(model: nn.Module, sample_shape: tuple[int, ...], micro_batch: int,
                       element_bytes: int = 4, input_dtype: torch.dtype = torch.float32) -> float:
    """Bytes autograd saves for backward in one forward of a meta-device model on ``micro_batch``
    samples, floating storages counted at ``element_bytes`` (an approximation of autocast, which
    keeps some ops such as norms in fp32)."""
    x = torch.empty((micro_batch, *sample_shape), dtype=input_dtype, device="meta")
    with SavedTensorMeter(parameter_storages(model), element_bytes=element_bytes) as meter:
        model(x)
    return float(meter.peak)
