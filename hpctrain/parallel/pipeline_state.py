"""A pipeline rank's checkpoint state under the whole model's names.

Each rank holds its stage(s) only, with the stage's own block numbering (``blocks.0`` of
stage 1 is the whole model's ``blocks.k``). Saved under the whole model's names, through
DCP, the stages' files form one model's checkpoint: it resumes at another dp degree, another
pp degree, or in one process (which loads every name). The optimizer state is saved
flattened (one entry per parameter name, param-group settings included), so that no entry
holds a list of another stage's parameter names.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from hpctrain.checkpoint.state import CheckpointMismatchError
from hpctrain.parallel import dcp_read
from hpctrain.parallel.pipeline import PipelineStep
from hpctrain.parallel.state import ShardedState, flat, optimizer_flattened

_OPTIM_SECTIONS = ("state", "param_groups")


def _global_optim_key(step: PipelineStep, key: str) -> str:
    section, rest = key.split(".", 1)
    if section not in _OPTIM_SECTIONS:
        raise ValueError(f"unexpected flattened optimizer key {key!r}")
    name, item = rest.rsplit(".", 1)
    return f"{section}.{step.global_name(name)}.{item}"


def pipeline_state(step: PipelineStep, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``{"model": ..., "optimizer": ...}`` of this rank's stage(s), whole-model names; live
    tensors (DTensor shards under FSDP), no copies. Every rank of the stage's dp group calls it."""
    model_sd, optim_sd = get_state_dict(step.model, optimizer, options=flat())
    return {"model": {step.global_name(k): v for k, v in model_sd.items()},
            "optimizer": {_global_optim_key(step, k): v for k, v in optim_sd.items()}}


def load_pipeline_state(step: PipelineStep, optimizer: torch.optim.Optimizer, path: str,
                        group: dist.ProcessGroup | None) -> None:
    """Read this rank's names from the DCP checkpoint at ``path`` (saved at any pp / dp degree,
    by :func:`pipeline_state`) into the stage(s) and the optimizer."""
    model_sd, optim_sd = get_state_dict(step.model, optimizer, options=flat())
    model_names = {step.global_name(k): k for k in model_sd}
    optim_names = {_global_optim_key(step, k): k for k in optim_sd}
    model_global: dict[str, Any] = {g: model_sd[k] for g, k in model_names.items()}
    optim_global: dict[str, Any] = {g: optim_sd[k] for g, k in optim_names.items()}
    # DCP loads tensors in place and replaces the other values in these dicts
    dcp_read.load({"model": model_global, "optimizer": optim_global}, path, process_group=group)
    set_state_dict(step.model, optimizer, options=flat(),
                   model_state_dict={k: model_global[g] for g, k in model_names.items()},
                   optim_state_dict={k: optim_global[g] for g, k in optim_names.items()})


class PipelineState(ShardedState):
    """A pipeline rank's stage(s) and their optimizer, checkpointed under the whole model's names."""

    def __init__(self, step: PipelineStep, optimizer: torch.optim.Optimizer, strategy: str) -> None:
        super().__init__(step.model, optimizer, strategy)
        self.step = step

    def sharded_state_dict(self) -> dict[str, Any]:
        return pipeline_state(self.step, self.optimizer)

    def load_sharded(self, path: str, group: Any) -> None:
        if not optimizer_flattened(path):
            raise CheckpointMismatchError(f"checkpoint {path} holds the optimizer in the older nested layout, which "
                                          "pipeline stages cannot split; hint: resume it without parallel.pp")
        load_pipeline_state(self.step, self.optimizer, path, group)

    def load_state_dict(self, state: dict[str, Any], source: Any = None) -> None:
        raise CheckpointMismatchError(f"checkpoint {source} holds the whole model (checkpoint.format=torch), which "
                                      "pipeline stages cannot split; hint: resume it without parallel.pp, then save "
                                      "with checkpoint.format=dcp")
