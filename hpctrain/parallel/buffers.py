"""Buffers (BatchNorm's running statistics and counters, any ``register_buffer``) kept in step
over the ranks that hold the same part of the model.

Parameters are kept equal by the gradient reduction; buffers are not: each rank's BatchNorm
updates its running statistics from its own micro-batches. DDP broadcasts rank 0's buffers
before each training forward, FSDP and DeepSpeed never touch them. So before every
validation, every checkpoint and ``model.pt``, :func:`sync_buffers` sets every rank's buffers
to the first rank's of its replica group (broadcast, as DDP does in training):

- exact and reproducible: rank 0's statistics are never changed by the sync, so they (and
  ``model.pt``, the logged validation and a resumed run) do not depend on when syncs happen;
- right for every buffer: an average of integer counters (``num_batches_tracked``) or of
  per-rank variances (which misses the spread between the ranks' means) is not the statistic
  one process would have, and is neither DDP's semantics nor exact.

``parallel.sync_batchnorm=true`` (:func:`convert_sync_batchnorm`) computes the batch statistics
over the data-parallel ranks instead, so every rank's running statistics are the same anyway.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from hpctrain.core.modules import replica_view
from hpctrain.core.section import ConfigError
from hpctrain.models.outputs import _LABELS, attach_labels

if TYPE_CHECKING:
    from hpctrain.config import Config

Groups = Sequence["dist.ProcessGroup | None"]  # None: the whole world


def ddp_sync_buffers(model: nn.Module) -> None:
    """A DDP-wrapped model's buffers set to its rank 0's over DDP's own process group (what
    its next training forward would do); nothing for any other model."""
    replica_view(model)


# ---------------------------------------------------------------- padding in training


def real_samples(inputs: Any, targets: torch.Tensor, mask: torch.Tensor | None
                 ) -> tuple[Any, torch.Tensor, torch.Tensor | None]:
    """A training micro-batch without its padding samples (``mask`` 0, ``data.drop_last=false``),
    so they never pass through forward: BatchNorm's batch and running statistics see real
    samples only. The mask comes back all ones (the loss's masked mean then gives 0, not NaN,
    for a batch that was all padding: its forward still runs, so collectives stay in step).
    Inputs of another kind (not a tensor or a dict of tensors) keep their padding."""
    if mask is None:
        return inputs, targets, None
    keep = mask.bool()
    if bool(keep.all()):
        return inputs, targets, mask
    size = keep.shape[0]
    if isinstance(inputs, torch.Tensor) and inputs.shape[:1] == (size,):
        sliced: Any = _slice_tensor(inputs, keep)
    elif isinstance(inputs, dict) and all(isinstance(v, torch.Tensor) and v.shape[:1] == (size,)
                                          for v in inputs.values()):
        sliced = {k: v[keep] for k, v in inputs.items()}
    else:
        return inputs, targets, mask
    return sliced, targets[keep], torch.ones(int(keep.sum()), dtype=mask.dtype, device=mask.device)


def _slice_tensor(inputs: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    out = inputs[keep]
    labels = getattr(inputs, _LABELS, None)  # for a model that computes its own loss (task.split)
    return attach_labels(out, labels[keep], None) if isinstance(labels, torch.Tensor) else out


# ---------------------------------------------------------------- SyncBatchNorm


def check_sync_batchnorm(cfg: Config) -> None:
    """``parallel.sync_batchnorm=true`` needs CUDA and NCCL (torch's SyncBatchNorm runs on
    accelerators only): a ConfigError (exit 2) before the process group otherwise."""
    p = cfg.parallel
    if not p.sync_batchnorm:
        return
    if not torch.cuda.is_available() or p.backend == "gloo":
        where = "parallel.backend=gloo" if torch.cuda.is_available() else "this machine has no CUDA GPU"
        raise ConfigError(f"parallel.sync_batchnorm=true needs CUDA GPUs with the NCCL backend ({where}; torch's "
                          "SyncBatchNorm does not run on CPU/gloo); hint: parallel.sync_batchnorm=false (the ranks' "
                          "BatchNorm buffers are still synced from rank 0 before validation and saving)")
    if p.pp > 1:
        raise ConfigError(f"parallel.sync_batchnorm=true does not combine with parallel.pp={p.pp} (the pipeline "
                          "stages run micro-batches one at a time); hint: parallel.sync_batchnorm=false")


def convert_sync_batchnorm(model: nn.Module, group: dist.ProcessGroup | None) -> nn.Module:
    """Every BatchNorm of ``model`` as a SyncBatchNorm over ``group`` (the data-parallel ranks;
    None: the world): batch statistics over the global batch, the same on every rank."""
    return nn.SyncBatchNorm.convert_sync_batchnorm(model, process_group=group)
