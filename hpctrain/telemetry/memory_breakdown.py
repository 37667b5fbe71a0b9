"""What a rank's training memory is made of, measured once, over the run's first optimizer step:
parameters, gradients and optimizer state (the bytes of the local tensors this rank holds,
:mod:`hpctrain.telemetry.footprint`), the parameters gathered whole (FSDP2 units) and
activations (the peak of the bytes autograd keeps for backward). The run's summary gets
``memory_breakdown``: one entry per rank.

Each part at its peak within the step, read from the tensors: gradients at the start of every
micro-step's forward (what the micro-steps before it accumulated: whole under
``parallel.reduce_every_microstep=false``, before the last one's reduce-scatter) and before
the optimizer step, the larger; gathered parameters at the start of each FSDP unit's forward,
while that unit's (and the root's) are gathered (a pipeline stage keeps its parameters gathered
and its gradients whole between micro-batches: seen from the first forward after a backward, so
with more micro-batches than stages on the first stage); parameters and optimizer state after
the step.

Activations are counted by :class:`hpctrain.telemetry.measure.SavedTensorMeter` (the estimator's
and the planner's rule): every tensor saved for backward passes its pack hook, each distinct
storage is counted once while it is held, and the peak of that sum is kept (so gradient
accumulation counts one micro-batch, and a pipeline schedule the micro-batches it has in
flight). Saved parameters (whole, or gathered by FSDP / ZeRO-3) are not activations and are
left out; autocast's low-precision weight copies are kept in (they live until backward like
any activation). Under activation checkpointing the count is what is saved outside the
checkpointed regions (their inputs, the head): the checkpoint keeps what its policy saves,
and recomputes the rest, out of the hooks' sight.

Off the hot path: the hooks are on from :meth:`MemoryProbe.arm` to the first optimizer step,
then removed; the ranks exchange their four numbers once (one small all-gather) after it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import astuple, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from hpctrain.telemetry.footprint import (
    distinct_bytes,
    gathered_params,
    grad_bytes,
    optimizer_bytes,
    param_tensors,
    sharded_units,
)
from hpctrain.telemetry.measure import SavedTensorMeter, storage_key

GATHER_TRIES = 20  # optimizer steps skipped (fp16 overflow) before the breakdown is given up


@dataclass(frozen=True)
class MemoryBreakdown:
    params: int
    grads: int
    optimizer: int
    activations: int
    gathered: int = 0  # parameters held gathered whole at once (FSDP2), at their peak

    def to_dict(self, rank: int) -> dict[str, int]:
        return {"rank": rank, "params_bytes": self.params, "grads_bytes": self.grads,
                "optimizer_bytes": self.optimizer, "activations_bytes": self.activations,
                "gathered_bytes": self.gathered}


class MemoryProbe:
    """``arm(model, optimizer)`` before the loop; ``after_step()`` after every optimizer step
    (every rank); ``summary()`` then has ``memory_breakdown``. ``model``: the module the loop
    trains (DDP/FSDP-wrapped, a pipeline stage, or a DeepSpeed engine); ``optimizer``: the
    torch optimizer the loop (or DeepSpeed's ZeRO optimizer) steps."""

    def __init__(self) -> None:
        self.local: MemoryBreakdown | None = None
        self.ranks: list[MemoryBreakdown] | None = None
        self._meter: SavedTensorMeter | None = None
        self._handles: list[RemovableHandle] = []
        self._grads = self._gathered = self._tries = 0
        self._optimizer: int | None = None
        self._param_bytes: Callable[[], int] = lambda: -1
        self._armed = self._counting = False
        self.pending = False  # armed and not yet gathered: the loop calls after_step only then

    def arm(self, model: nn.Module, optimizer: Any) -> None:
        if self._armed:
            return  # once per run
        params = {k for k in map(storage_key, param_tensors(model)) if k is not None}
        self._meter = SavedTensorMeter(exclude=params, real_only=True).__enter__()
        self._armed = self._counting = self.pending = True
        inner = getattr(optimizer, "optim", None)  # ZeroRedundancyOptimizer steps its shard's optimizer
        hooked = inner if isinstance(inner, torch.optim.Optimizer) else optimizer

        def grads(*_: Any) -> None:  # a micro-step starts: the gradients the ones before it left
            self._grads = max(self._grads, grad_bytes(model, optimizer))

        def gathered(*_: Any) -> None:  # a unit's forward starts: its parameters (and the root's) gathered
            self._gathered = max(self._gathered, distinct_bytes(gathered_params(model)))

        def before(*_: Any) -> None:  # gradients complete, activations used: measure, stop counting
            grads()
            self._stop_counting()

        def after(*_: Any) -> None:  # the optimizer state exists from the first step on
            self._optimizer = optimizer_bytes(model, optimizer)
            self.disarm()

        # the parameters once the whole step is over (DeepSpeed ZeRO-3 re-gathers those it keeps whole)
        self._param_bytes = lambda: distinct_bytes(param_tensors(model))

        self._handles = [hooked.register_step_pre_hook(before), hooked.register_step_post_hook(after),
                         model.register_forward_pre_hook(grads)]
        # after FSDP's own pre-forward hooks (they gather); a compiled unit would trace the hook: left out
        self._handles += [unit.register_forward_pre_hook(gathered) for unit in sharded_units(model)
                          if getattr(unit, "_compiled_call_impl", None) is None]

    def _stop_counting(self) -> None:
        if self._counting and self._meter is not None:
            self._meter.__exit__(None, None, None)  # the saved-tensor hooks off, exactly once
        self._counting = False

    def disarm(self) -> None:
        """Remove every hook (also for a run that ends before its first step)."""
        self._stop_counting()
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def after_step(self) -> None:
        """Every rank, after each optimizer step until the breakdown is gathered: one all-gather
        of four numbers (an fp16-skipped step leaves a rank's at -1; all ranks skip together)."""
        if not self._armed or self.ranks is not None or self._tries >= GATHER_TRIES:
            self.pending = False
            return  # never armed (a loop without the probe), done, or given up: no collective
        self._tries += 1
        if self.local is None and self._optimizer is not None:
            activations = self._meter.peak if self._meter is not None else 0
            self.local = MemoryBreakdown(self._param_bytes(), self._grads, self._optimizer, activations, self._gathered)
        mine = self.local or MemoryBreakdown(-1, -1, -1, -1, -1)
        if not (dist.is_available() and dist.is_initialized()):
            self.ranks = [mine] if self.local is not None else None
            self.pending = self.ranks is None and self._tries < GATHER_TRIES
            return
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
        local = torch.tensor(astuple(mine), dtype=torch.int64, device=device)
        # all_gather (a list of tensors): all_gather_into_tensor warns (FutureWarning) in torch 2.13,
        # and its successor all_gather_single does not exist in older torch
        gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, local)
        rows = [MemoryBreakdown(*map(int, row.tolist())) for row in gathered]
        if all(row.params >= 0 for row in rows):
            self.ranks = rows
        self.pending = self.ranks is None and self._tries < GATHER_TRIES

    def summary(self) -> dict[str, Any]:
        if self.ranks is None:
            return {}
        return {"memory_breakdown": [row.to_dict(rank) for rank, row in enumerate(self.ranks)]}
