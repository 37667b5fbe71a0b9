"""Model and optimizer as a checkpoint sees them, supplied by the strategy that holds them.

The checkpointer (hpctrain.checkpoint) saves a mapping of ``Stateful`` objects and knows no
strategy. The entry for model + optimizer is one of these views: it says which format fits
(``torch``: whole tensors that rank 0 writes; ``dcp``: every rank's shards through
torch.distributed.checkpoint), gives its state for that format, and loads either format back
(a DDP checkpoint into FSDP shards, a sharded one into a whole model, at any world size).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from hpctrain.checkpoint.state import CheckpointMismatchError
from hpctrain.checkpoint.writer import storage_ptr
from hpctrain.parallel.buffers import ddp_sync_buffers
from hpctrain.parallel.wrappers import unwrap

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import StateDictOptions


def dcp_api() -> ModuleType:
    """torch's DCP state-dict API, imported on first use: DTensor and sympy come with it, 0.8 s
    of every rank's start-up that a run which never saves in DCP format (DDP, one process) skips."""
    import torch.distributed.checkpoint.state_dict as api

    return api


def flat() -> StateDictOptions:
    """The optimizer saved flattened: one entry per parameter name, so any split of the model
    reads its own names."""
    return dcp_api().StateDictOptions(flatten_optimizer_state_dict=True)


def _mismatch(source: Any, err: Exception) -> CheckpointMismatchError:
    return CheckpointMismatchError(
        f"checkpoint {source} does not fit this model ({' '.join(str(err).split())[:300]}); hint: "
        "resume with the model.name and model.num_classes that wrote it, or resume=never")


class ModelState(Protocol):
    """What the checkpointer needs of the model + optimizer entry (see WholeState for each method)."""

    format: str
    strategy: str
    optimizer: torch.optim.Optimizer

    def gather(self) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def sharded_state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any], source: Any = None) -> None: ...
    def load_sharded(self, path: str, group: Any) -> None: ...
    def live_tensors(self) -> dict[str, torch.Tensor] | None: ...
    def step_storages(self) -> set[int]: ...
    def nbytes(self) -> int: ...


class WholeState:
    """A whole model and its optimizer on every rank (one process, DDP, ZeRO-1)."""

    format = "torch"

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, strategy: str = "ddp") -> None:
        self.model, self.optimizer, self.strategy = model, optimizer, strategy
        # every rank's buffers made rank 0's before a save, so the checkpoint holds one copy and a
        # resume gives every rank the same (a strategy sets its own; default: a DDP model's group)
        self.before_save: Callable[[], None] = functools.partial(ddp_sync_buffers, model)

    def gather(self) -> None:
        """Before a save, on every rank, whatever the format: buffers synced (a collective), and
        where the state is split (ZeRO-1) the optimizer state consolidated."""
        self.before_save()

    def state_dict(self) -> dict[str, Any]:
        """``{"model": ..., "optimizer": ...}`` for this view's format; references, no copies."""
        return {"model": unwrap(self.model).state_dict(), "optimizer": self.optimizer.state_dict()}

    def sharded_state_dict(self) -> dict[str, Any]:
        """Model and optimizer for DCP under the whole model's names, the optimizer flattened to one
        entry per name, so any split of the model (fsdp at any world size, pp x dp, one process) reads it."""
        model_sd, optim_sd = dcp_api().get_state_dict(self.model, self.optimizer, options=flat())
        return {"model": model_sd, "optimizer": optim_sd}

    def load_state_dict(self, state: dict[str, Any], source: Any = None) -> None:
        """Whole (format=torch) model and optimizer state."""
        try:
            unwrap(self.model).load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        except (RuntimeError, ValueError, KeyError) as err:  # another model's checkpoint: bad input, not a bug
            raise _mismatch(source, err) from err

    def load_sharded(self, path: str, group: Any) -> None:
        """A format=dcp checkpoint (saved at any world size, by any split of the model)."""
        from hpctrain.checkpoint import dcp_read

        api = dcp_api()
        options = api.StateDictOptions(flatten_optimizer_state_dict=optimizer_flattened(path))
        model_sd, optim_sd = api.get_state_dict(self.model, self.optimizer, options=options)
        dcp_read.load({"model": model_sd, "optimizer": optim_sd}, path, process_group=group)
        api.set_state_dict(self.model, self.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd,
                       options=options)

    def live_tensors(self) -> dict[str, torch.Tensor] | None:
        """The model's live tensors by state-dict name: a whole checkpoint is read straight into them."""
        return dict(unwrap(self.model).state_dict())

    def step_storages(self) -> set[int]:
        """Storages only ``optimizer.step()`` changes (parameters, optimizer state): an async
        save may copy them while the next forward/backward runs. Buffers change in forward."""
        ptrs = {storage_ptr(p) for p in self.model.parameters()}
        for state in self.optimizer.state.values():
            ptrs |= {storage_ptr(v) for v in state.values() if isinstance(v, torch.Tensor)}
        return ptrs

    def nbytes(self) -> int:
        """Bytes of parameters and optimizer state on this rank (the checkpoint's size, for Young-Daly)."""
        tensors: list[torch.Tensor] = list(self.model.parameters())
        for state in self.optimizer.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
        return sum(t.numel() * t.element_size() for t in tensors)


class Zero1State(WholeState):
    """ZeRO-1: the optimizer state is split over the ranks; a save consolidates it on rank 0
    (a one-process optimizer's layout, so any world size, or ddp, resumes it; ZeRO-1 re-splits)."""

    def gather(self) -> None:
        super().gather()
        self.optimizer.consolidate_state_dict(to=0)  # type: ignore[attr-defined]  # ZeroRedundancyOptimizer


class ShardedState(WholeState):
    """FSDP / tensor parallel: this rank's shards, saved through DCP under the whole model's names."""

    format = "dcp"

    def load_state_dict(self, state: dict[str, Any], source: Any = None) -> None:
        """A whole (format=torch) checkpoint into shards: every rank keeps its own shard of each
        tensor. The optimizer's parameter indices become names, in ``model.parameters()`` order."""
        names = [name for name, param in unwrap(self.model).named_parameters() if param.requires_grad]
        saved = state["optimizer"]
        try:
            optim: dict[str, Any] = {
                "state": {names[int(i)]: value for i, value in saved["state"].items()},
                "param_groups": [{**group, "params": [names[int(i)] for i in group["params"]]}
                                 for group in saved["param_groups"]]}
            api = dcp_api()
            api.set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=optim,
                               options=api.StateDictOptions(full_state_dict=True))
        except (RuntimeError, ValueError, KeyError, IndexError) as err:  # another model's checkpoint: bad input
            raise _mismatch(source, err) from err

    def live_tensors(self) -> dict[str, torch.Tensor] | None:
        return None  # shards: a whole checkpoint is read into memory, then split (load_state_dict)


def optimizer_flattened(path: str) -> bool:
    """Did the save flatten the optimizer (``optimizer.param_groups.<name>.<key>`` entries)?
    Checkpoints written before it was saved flattened load too."""
    from hpctrain.checkpoint import dcp_read

    names = dcp_read.read_metadata(path).state_dict_metadata
    return any(name.startswith("optimizer.param_groups.") for name in names)
