"""Exact validation through pipeline stages (``parallel.pp > 1``).

The stages run forward only, through the training schedule's own forward-only path
(``schedule.eval``); the last stage turns the logits into the task's per-target losses
and updates the metrics; the metric states are then merged over every rank in one
exchange (the other stages contribute empty states), so every rank, the first stage's
rank 0 included, gets the single-process numbers.

The schedule's buffers are sized for one batch shape per mode, so every validation batch
is padded to one size (a multiple of ``parallel.microbatches``) with masked samples that
count nowhere; data-parallel replicas run as many batches as the longest one (FSDP stages
gather their parameters over dp in every forward), the short ones on masked batches.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from hpctrain.core.env import ClusterEnv
from hpctrain.data import EvalBatches
from hpctrain.data.batch import Batch, main_input, map_inputs
from hpctrain.evaluation.evaluate import EvalResult, evaluate_sources, lockstep
from hpctrain.precision import Precision
from hpctrain.tasks import Task
from hpctrain.tasks.metrics import Metric


class Stages(Protocol):
    """What evaluation needs of a pipeline (the pipeline strategy's step,
    :class:`hpctrain.parallel.pipeline.PipelineStep`): this rank's stage modules, the
    micro-batches per batch, and a forward-only pass over a whole batch."""

    modules: list[nn.Module]
    microbatches: int

    def forward_only(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None: ...


class _Logits(nn.Module):
    """Hands the pipeline's logits to ``task.eval_step``, which owns masking and the losses."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.logits = logits

    def forward(self, inputs: Any, doc_ids: Any = None) -> torch.Tensor:  # doc_ids: the task hands packed ones
        return self.logits


def padded_size(batch_size: int, microbatches: int) -> int:
    """The one batch size every validation batch is padded to: a multiple of the micro-batches."""
    return -(-batch_size // microbatches) * microbatches


def pad_batch(batch: Batch, size: int) -> Batch:
    """``batch`` with masked all-zero samples appended up to ``size`` samples."""
    real = len(batch)
    if real > size:
        raise ValueError(f"a validation batch of {real} samples exceeds the padded size {size}")
    extra = size - real

    def grow(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t.new_zeros((extra, *t.shape[1:]))]) if extra else t

    device = main_input(batch.inputs).device
    mask = batch.mask if batch.mask is not None else torch.ones(real, dtype=torch.bool, device=device)
    keys: torch.Tensor | list[str] = grow(batch.keys) if isinstance(batch.keys, torch.Tensor) else [
        *batch.keys, *[""] * extra]
    return Batch(map_inputs(batch.inputs, grow), grow(batch.targets), keys, grow(mask.bool()))


@torch.no_grad()
def evaluate_pipeline(step: Stages, loader: EvalBatches, metrics: Sequence[Metric], env: ClusterEnv,
                      device: torch.device, precision: Precision | None, *, task: Task,
                      batch_size: int, leader: bool = True) -> EvalResult:
    """``metrics`` over ``loader`` (this data-parallel replica's share) through the stages;
    the merged, global values on every rank. Every rank calls it. ``leader``: this rank counts
    its stage's outputs; False on all but one tensor-parallel rank of a stage, whose outputs
    are the same. A mixture's loader (``loader.sources``): each source's metrics too."""
    if getattr(loader, "sources", None):
        return evaluate_sources(lambda part, mine: evaluate_pipeline(step, part, mine, env, device, precision,
                                                                     task=task, batch_size=batch_size, leader=leader),
                                loader.sources, metrics)  # type: ignore[attr-defined]
    start = time.perf_counter()
    size = padded_size(batch_size, step.microbatches)
    was_training = [m.training for m in step.modules]
    for module in step.modules:
        module.eval()
    for metric in metrics:
        metric.reset()
    try:
        for batch in lockstep(loader, env, device):  # every replica runs as many batches as the longest
            batch = pad_batch(batch, size).to(device)  # one shape for the schedule's buffers
            inputs, targets = task.split(batch)
            with precision.autocast() if precision else torch.autocast("cpu", enabled=False):
                logits = step.forward_only(inputs, targets)
            out = task.eval_step(_Logits(logits), batch, None) if logits is not None else None
            if out is None or not leader:  # not the last stage, a batch of padding only, or a tp twin
                continue
            for metric in metrics:
                metric.update(out)
    finally:
        for module, mode in zip(step.modules, was_training):
            module.train(mode)
    return EvalResult(_merge(metrics, env), time.perf_counter() - start)


def _merge(metrics: Sequence[Metric], env: ClusterEnv) -> dict[str, Any]:
    """Every rank's metric states in one all-gather (only the last stages' are non-empty),
    folded in rank order: sums and counts, so the result is the single-process one."""
    if env.distributed:
        gathered: list[Any] = [None] * env.world_size
        dist.all_gather_object(gathered, [{k: v.cpu() for k, v in m.states.items()} for m in metrics])
        for index, metric in enumerate(metrics):
            metric.merge([rank_states[index] for rank_states in gathered])
    result: dict[str, Any] = {}
    for metric in metrics:
        result.update(metric.compute())
    return result
