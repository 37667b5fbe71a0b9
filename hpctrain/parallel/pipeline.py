"""Pipeline parallelism with ``torch.distributed.pipelining``: the transformer blocks are
split into consecutive stages, one per pipeline rank (``pp`` x ``virtual_stages`` for
interleaved 1F1B), and a schedule (GPipe, 1F1B, interleaved 1F1B) runs the micro-batches.

The schedule runs forward and backward, so the training loop calls a step function,
:class:`PipelineStep`, instead of ``model(inputs)`` + ``loss.backward()``.

The cut is the model family's :class:`~hpctrain.models.family.PipelineSplit`: which
``nn.ModuleList`` holds the blocks, which parts only the first stage (embeddings) and the last
(final norm, head) keep, and the stage module that runs a cut model. The default family's is
the ``blocks`` layout: the top-level children registered before ``blocks`` run before it, those
after it after it, and ``forward`` skips a child that is None and takes hidden states instead
of token ids when the embeddings are gone. A stage keeps the whole model's parameter names
(its blocks renumbered from 0). Tied weights between the two ends are not supported (each end
would train its own copy).

Dict inputs (packed documents' ``{tokens, doc_ids}``, ``{input_ids, attention_mask}``): the main
input enters the first stage, the others its forward names reach every stage as keyword
arguments (the schedule splits them into the same micro-batches), so each stage masks its
attention as the whole model does in one process (:func:`hpctrain.tasks.inputs.stage_inputs`).
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

from hpctrain.models.family import PipelineSplit, family_of
from hpctrain.models.shape import stage_layers
from hpctrain.tasks.inputs import forward_names, stage_inputs

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def split_blocks(n_blocks: int, n_stages: int) -> list[range]:
    """Consecutive block ranges, as even as possible; any number of blocks >= stages (uneven
    stages: 5 blocks on 2 stages are 2 + 3, Llama 3 405B's 126 on 16 are 7, 8 x 14, 7). The
    estimator's rule (:func:`hpctrain.models.shape.stage_layers`), so ``hpctrain estimate
    --pp`` sizes the stages a run builds: a remainder goes to the middle stages, then the last,
    then the first, which holds the embedding and, under 1F1B, the most micro-batches in flight."""
    if n_blocks < n_stages:
        raise ValueError(f"pipeline: {n_blocks} blocks cannot fill {n_stages} stages; hint: lower parallel.pp "
                         "(or parallel.virtual_stages)")
    bounds = list(itertools.accumulate(stage_layers(n_blocks, n_stages), initial=0))
    return [range(start, stop) for start, stop in zip(bounds, bounds[1:])]


def model_split(model: nn.Module) -> PipelineSplit:
    """The pipeline split of ``model``'s family; a ValueError when it has none (or no such blocks)."""
    split = family_of(model).pipeline_split_of(model)
    blocks = _submodule(model, split.blocks) if split is not None else None
    if split is None or not isinstance(blocks, nn.ModuleList):
        where = f"`{split.blocks}`" if split is not None else "`blocks`"
        raise ValueError(f"pipeline parallel needs the model's transformer blocks as {where} (an nn.ModuleList); "
                         f"{type(model).__name__} has none")
    return split


def _submodule(model: nn.Module, path: str) -> nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def _check_untied(model: nn.Module, before: Sequence[str], after: Sequence[str]) -> None:
    def ids(paths: Sequence[str]) -> set[int]:
        return {id(p) for path in paths for p in _parameters(model, path)}

    if ids(before) & ids(after):
        raise ValueError("pipeline parallel: the embedding and the head share weights (weight tying); "
                         "hint: untie them (e.g. the gpt model's tie_weights=false) for parallel.pp > 1")


def _parameters(model: nn.Module, path: str) -> list[nn.Parameter]:
    part = _submodule(model, path)
    return list(part.parameters()) if part is not None else []


def _replace(model: nn.Module, path: str, value: nn.Module | None) -> None:
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, name, value)


def stage_module(model: nn.Module, stage: int, n_stages: int, *, copy_model: bool = False) -> nn.Module:
    """``model`` cut down to stage ``stage`` of ``n_stages`` (in place unless ``copy_model``), as
    its family's split says: the stage's blocks, the first/last stage's ends, the stage module."""
    split = model_split(model)
    _check_untied(model, split.first, split.last)
    part = copy.deepcopy(model) if copy_model else model
    blocks = part.get_submodule(split.blocks)
    assert isinstance(blocks, nn.ModuleList)  # checked by model_split
    keep = split_blocks(len(blocks), n_stages)[stage]
    _replace(part, split.blocks, nn.ModuleList(blocks[i] for i in keep))
    for path in (split.first if stage > 0 else ()) + (split.last if stage < n_stages - 1 else ()):
        _replace(part, path, None)
    return split.stage(part) if split.stage is not None else part


def check_split(model: nn.Module, n_stages: int) -> None:
    """Can ``model`` (built on meta) be cut into ``n_stages``? A ValueError says why not."""
    split = model_split(model)
    _check_untied(model, split.first, split.last)
    split_blocks(len(list(model.get_submodule(split.blocks).children())), n_stages)


def local_stage_ids(pp_rank: int, pp: int, schedule: str, virtual_stages: int) -> list[int]:
    """Stage indices this pipeline rank runs: its own, or every pp-th one (looped) when interleaved."""
    if schedule != "interleaved_1f1b":
        return [pp_rank]
    return [pp_rank + k * pp for k in range(virtual_stages)]


class PipelineStep:
    """``step(inputs, targets) -> loss``: forward and backward of one batch through the schedule.

    Gradients land in the stage modules' ``.grad`` as for ``loss.backward()`` on the batch
    mean loss divided by ``grad_accum`` (the loop steps the optimizer after ``grad_accum``
    calls). Returns the batch's mean loss (not divided by ``grad_accum``) on every pipeline
    rank (broadcast from the last stage), a 0-dim tensor.
    """

    def __init__(self, stages: Sequence[PipelineStage], modules: Sequence[nn.Module], *, schedule: str,
                 microbatches: int, loss_fn: LossFn, group: dist.ProcessGroup, grad_accum: int = 1,
                 block_offsets: Sequence[int] | None = None, blocks_path: str = "blocks") -> None:
        self.modules, self.microbatches, self.group = list(modules), microbatches, group
        self.blocks_path = blocks_path.split(".")  # where the stage's blocks are (the family's split)
        # Global index of each local module's first block: names in checkpoints are the whole model's.
        self.block_offsets = list(block_offsets) if block_offsets is not None else [0] * len(self.modules)
        # This rank's stage module, or its stages in an nn.ModuleList (interleaved 1F1B): what the
        # loop holds as the model and the optimizer steps; its names map by global_name().
        self.model: nn.Module = self.modules[0] if len(self.modules) == 1 else nn.ModuleList(self.modules)
        self.has_first = any(s.is_first for s in stages)
        self.has_last = any(s.is_last for s in stages)
        scale = 1.0 / (microbatches * grad_accum)
        # scale_grads=False + a loss pre-divided by microbatches x grad_accum: the gradients sum
        # to the accumulated batch mean's, as with the unpipelined loop's loss / grad_accum.
        self.schedule = _make_schedule(schedule, list(stages), microbatches,
                                       lambda out, tgt: self._scaled(loss_fn(out, tgt) * scale))
        self.unscale = float(grad_accum)  # the recorded losses are mean / grad_accum in sum
        # precision=fp16: the loop's GradScaler (a ShardedGradScaler, whose inf check is one
        # all-reduce over every rank, so all stages skip an overflowed step together). The
        # loss is scaled inside the schedule's loss function: backward starts from it there.
        self.grad_scaler: torch.amp.GradScaler | None = None
        self.signature = forward_names(self.modules[0])  # every stage module's forward is the same one

    def parameters(self) -> list[nn.Parameter]:
        """This rank's parameters (all its stages): give these to the optimizer."""
        return [p for module in self.modules for p in module.parameters()]

    def global_name(self, fqn: str) -> str:
        """A name in :attr:`model` as the whole (unpipelined) model has it: the stage's
        ``blocks.i`` (the split's blocks path) renumbered to the global block index (and the
        ModuleList index dropped)."""
        parts = fqn.split(".")
        index = 0
        if len(self.modules) > 1:
            index, parts = int(parts[0]), parts[1:]
        depth = len(self.blocks_path)
        if len(parts) > depth and parts[:depth] == self.blocks_path:
            parts[depth] = str(int(parts[depth]) + self.block_offsets[index])
        return ".".join(parts)

    def forward_only(self, inputs: Any, targets: torch.Tensor) -> torch.Tensor | None:
        """The whole batch's outputs through the stages without backward (torch's own
        ``schedule.eval``): the logits on the last stage's rank, None on the others. Call it
        with the same batch shape each time (the stages' buffers are sized once per mode).
        ``targets``: the schedule's last stage computes its loss in eval too (ignored here)."""
        args, kwargs, _ = self._inputs(inputs)
        if not self.has_last:
            self.schedule.eval(*args, **kwargs)
            return None
        out = self.schedule.eval(*args, target=targets, **kwargs)
        return out if isinstance(out, torch.Tensor) else None

    def __call__(self, inputs: Any, targets: torch.Tensor) -> torch.Tensor:
        args, kwargs, main = self._inputs(inputs)
        if self.grad_scaler is not None:  # every stage's scaler holds a scale to unscale by (the last one's scales)
            self.grad_scaler.scale(torch.ones((), device=main.device))
        losses: list[torch.Tensor] = []
        if self.has_last:
            self.schedule.step(*args, target=targets, losses=losses, **kwargs)
        else:
            self.schedule.step(*args, **kwargs)
        loss = torch.stack(losses).sum() * self.unscale if losses else torch.zeros(())
        if losses and self.grad_scaler is not None:
            loss = loss / self.grad_scaler.get_scale()  # a power of two: exact
        return self._share(loss.detach(), main.device)

    def _inputs(self, inputs: Any) -> tuple[tuple[torch.Tensor, ...], dict[str, Any], torch.Tensor]:
        """The first stage's positional input, every stage's keywords, and the main input tensor."""
        main, kwargs = stage_inputs(self.modules[0], inputs, self.signature)
        if main.shape[0] % self.microbatches:
            raise ValueError(f"pipeline: the batch of {main.shape[0]} samples does not split into "
                             f"parallel.microbatches={self.microbatches} equal micro-batches")
        return ((main,) if self.has_first else ()), kwargs, main

    def _scaled(self, loss: torch.Tensor) -> torch.Tensor:
        return self.grad_scaler.scale(loss) if self.grad_scaler is not None else loss

    def _share(self, loss: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Every pipeline rank gets the last stage's loss (for logging and agreement)."""
        staged = loss.to(torch.float32).to(device if dist.get_backend(self.group) == "nccl" else "cpu").reshape(1)
        dist.broadcast(staged, group=self.group, group_src=dist.get_world_size(self.group) - 1)
        return staged[0]


def _make_schedule(name: str, stages: list[PipelineStage], microbatches: int,
                   loss_fn: LossFn) -> PipelineScheduleSingle | PipelineScheduleMulti:
    if name == "interleaved_1f1b":
        return ScheduleInterleaved1F1B(list[Any](stages), microbatches, loss_fn=loss_fn, scale_grads=False)
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}.get(name)
    if kind is None:
        raise ValueError(f"parallel.pp_schedule={name!r} is not one of gpipe, 1f1b, interleaved_1f1b")
    if len(stages) != 1:
        raise ValueError(f"pp_schedule={name} runs one stage per rank, got {len(stages)}")
    return kind(stages[0], microbatches, loss_fn=loss_fn, scale_grads=False)


def build_pipeline(model: nn.Module, *, pp_group: dist.ProcessGroup, device: torch.device, schedule: str,
                   microbatches: int, loss_fn: LossFn, virtual_stages: int = 2, grad_accum: int = 1,
                   wrap: Callable[[nn.Module], nn.Module] | None = None) -> PipelineStep:
    """Cut ``model`` into this rank's stage(s), optionally ``wrap`` each (e.g. FSDP over dp), and
    return the step function. ``model`` is consumed (cut in place, or copied per virtual stage)."""
    pp, pp_rank = dist.get_world_size(pp_group), dist.get_rank(pp_group)
    ids = local_stage_ids(pp_rank, pp, schedule, virtual_stages)
    n_stages = pp * len(ids)
    split = model_split(model)  # the contract checked before the blocks are read
    offsets = [split_blocks(len(list(model.get_submodule(split.blocks).children())), n_stages)[i].start for i in ids]
    modules = [stage_module(model, i, n_stages, copy_model=len(ids) > 1) for i in ids]
    if wrap is not None:
        modules = [wrap(m) for m in modules]
    stages = [PipelineStage(m, i, n_stages, device, group=pp_group) for m, i in zip(modules, ids)]
    return PipelineStep(stages, modules, schedule=schedule, microbatches=microbatches, loss_fn=loss_fn,
                        group=pp_group, grad_accum=grad_accum, block_offsets=offsets, blocks_path=split.blocks)
