"""A real model measured on the meta device: its parameters, the activations autograd saves
and its FLOPs, with no memory and no compute. The only part of the estimator that needs
torch: sizing by ``--params`` or a transformer shape never imports it.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from hpctrain.core.errors import UserError
from hpctrain.models import REGISTRY, build_model


def meta_model(name: str) -> nn.Module:
    """Build a registered model (or ``package.module:factory``) without allocating its weights."""
    try:
        with torch.device("meta"):
            return build_model(name)
    except UserError as err:
        raise UserError(f"--model: {err}") from err


def input_shape(name: str) -> tuple[int, ...] | None:
    """The per-sample input shape a registered model declares; None for user factories."""
    spec = REGISTRY.get(name)
    return spec.input_shape if spec else None


def input_dtype(name: str) -> torch.dtype:
    """The input dtype a registered model declares (int64 tokens for ``gpt``); float otherwise."""
    spec = REGISTRY.get(name)
    return spec.input_dtype if spec else torch.float32


def saved_tensor_bytes(model: nn.Module, sample_shape: tuple[int, ...], micro_batch: int,
                       element_bytes: int = 4, input_dtype: torch.dtype = torch.float32) -> float:
    """Bytes of the tensors autograd saves for backward in one forward of a meta-device model.

    Any architecture, no memory used: the forward runs on the meta device under a
    saved-tensors hook. Parameters are not activations and are left out; a tensor saved
    twice counts once. Floating tensors are rescaled from their dtype to ``element_bytes``
    (an approximation of autocast, which keeps some ops such as norms in fp32).
    """
    params = {id(p) for p in model.parameters()}
    saved: dict[int, torch.Tensor] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in params and id(t._base) not in params:  # a weight or its transpose is no activation
            saved[id(t)] = t
        return t

    x = torch.empty((micro_batch, *sample_shape), dtype=input_dtype, device="meta")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return float(sum(t.numel() * (element_bytes if t.is_floating_point() else t.element_size())
                     for t in saved.values()))


def counted_per_sample(model: nn.Module, sample_shape: tuple[int, ...], batch: int = 2,
                       dtype: torch.dtype = torch.float32) -> float:
    """Forward+backward FLOPs per sample, counted on the meta device (no memory, no compute)."""
    x = torch.empty((batch, *sample_shape), dtype=dtype, device="meta")
    with FlopCounterMode(display=False) as counter:
        model(x).sum().backward()
    return counter.get_total_flops() / batch
