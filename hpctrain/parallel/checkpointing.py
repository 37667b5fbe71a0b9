"""Activation checkpointing: keep less in forward, recompute it in backward.

``block`` wraps every transformer block (every child module for other models): only the
block inputs stay alive between forward and backward, and each block runs forward twice.
``selective`` keeps the outputs of the matrix multiplications (the expensive part) and
recomputes the cheap element-wise ops (norms, activations, softmax), trading less memory
saved for little recompute. Applied after tensor parallel and before compile and FSDP.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from hpctrain.parallel.units import shard_units

# Outputs worth keeping: recomputing them costs a matmul; everything else is cheap to redo.
_SAVE = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
         torch.ops.aten._scaled_dot_product_flash_attention.default,
         torch.ops.aten._scaled_dot_product_efficient_attention.default,
         torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}


def _policy(_ctx: Any, op: Any, *_args: Any, **_kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context() -> Any:
    return create_selective_checkpoint_contexts(_policy)


def apply_activation_checkpointing(model: nn.Module, *, mode: str) -> nn.Module:
    """Wrap each block (in place, inside its parent) for ``mode`` = none | block | selective."""
    if mode == "none":
        return model
    if mode not in ("block", "selective"):
        raise ValueError(f"parallel.activation_checkpointing={mode!r} is not one of none, block, selective")
    options: dict[str, Any] = {"preserve_rng_state": True}  # the wrapper is non-reentrant by default
    if mode == "selective":
        options["context_fn"] = functools.partial(_selective_context)
    units = {id(unit) for unit in shard_units(model)}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if id(child) in units:
                parent.register_module(name, checkpoint_wrapper(child, **options))
    return model
