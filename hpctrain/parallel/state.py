"""Model and optimizer as a checkpoint sees them: the views of hpctrain's own on-disk formats.

The checkpointer (hpctrain.checkpoint) saves a mapping of ``Stateful`` objects and knows no
strategy. The entry for model + optimizer is a :class:`~hpctrain.checkpoint.view.CheckpointView`
made by the strategy that holds them: ``torch`` (:class:`WholeState`: whole tensors in the
replicated files, rank 0 writes them) or ``dcp`` (:class:`ShardedState`: every rank's shards
through torch.distributed.checkpoint, under the whole model's names). Each loads the other
format too: a DDP checkpoint into FSDP shards, a sharded one into a whole model, at any world
size. Both register themselves here; :mod:`hpctrain.parallel.checkpoint_formats` names them by
import path for commands that load no torch.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from hpctrain.checkpoint import layout
from hpctrain.checkpoint.checkpointer import load_replicated
from hpctrain.checkpoint.state import REPLICATED, CheckpointMismatchError
from hpctrain.checkpoint.view import CheckpointView, manifest_format, register_format
from hpctrain.checkpoint.writer import storage_ptr
from hpctrain.core.errors import agree
from hpctrain.core.modules import unwrap
from hpctrain.core.safe_pickle import UnsafePickleError
from hpctrain.parallel.buffers import ddp_sync_buffers
from hpctrain.weights import frozen
from hpctrain.weights.export import LiveBytes, Source, TensorSpec, dict_source

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

WHOLE, DCP = "torch", "dcp"  # the formats' names in a manifest
SHARDED_DIR = "sharded"  # format=dcp: the DCP files, inside the checkpoint directory

def dcp_api() -> ModuleType:
    """torch's DCP state-dict API, imported on first use: DTensor and sympy come with it, 0.8 s
    of every rank's start-up that a run which never saves in DCP format (DDP, one process) skips."""
    import torch.distributed.checkpoint.state_dict as api

    return api


def flat(model: nn.Module | None = None) -> StateDictOptions:
    """The optimizer saved flattened: one entry per parameter name, so any split of the model
    reads its own names; a frozen base (LoRA) is left out (its construction brings it back)."""
    frozen_base = model is not None and frozen.has_frozen_base(model)
    return dcp_api().StateDictOptions(flatten_optimizer_state_dict=True, ignore_frozen_params=frozen_base)


def _mismatch(source: Any, err: Exception) -> CheckpointMismatchError:
    return CheckpointMismatchError(
        f"checkpoint {source} does not fit this model ({' '.join(str(err).split())[:300]}); hint: "
        "resume with the model.name and model.num_classes that wrote it, or resume=never")


ModelState = CheckpointView  # the name strategies give their checkpoint_state()'s type


class WholeState(CheckpointView):
    """A whole model and its optimizer on every rank (one process, DDP, ZeRO-1): saved whole into
    the replicated files (format=torch), or through DCP where ``checkpoint.format=dcp`` asks."""

    format = WHOLE
    reads = (DCP,)
    written_by = "a strategy other than deepspeed"

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, strategy: str = "ddp") -> None:
        self.model, self.optimizer, self.strategy = model, optimizer, strategy
        # every rank's buffers made rank 0's before a save, so the checkpoint holds one copy and a
        # resume gives every rank the same (a strategy sets its own; default: a DDP model's group)
        self.before_save: Callable[[], None] = functools.partial(ddp_sync_buffers, model)
        # a frozen base (LoRA) is saved as its digest only, computed once (it never changes; under
        # FSDP a collective, so on every rank in gather, before rank 0 writes it)
        self.frozen_base = frozen.has_frozen_base(model)
        self._base: dict[str, Any] | None = None

    def for_format(self, name: str) -> CheckpointView:
        """``checkpoint.format=dcp``: the same model saved through DCP (any split reads it)."""
        if name != DCP or self.format == DCP:
            return self
        view = _DcpOf(self.model, self.optimizer, self.strategy)
        view.before_save, view.whole = self.before_save, self
        return view

    def gather(self) -> None:
        """Before a save, on every rank, whatever the format: buffers synced (a collective), and
        where the state is split (ZeRO-1) the optimizer state consolidated."""
        self.before_save()
        self.base_record()

    def base_record(self) -> dict[str, Any] | None:
        """The frozen base's record (digest, count, PEFT adapters), once; None without a frozen base."""
        if self.frozen_base and self._base is None:
            self._base = frozen.base_record(self.model)
        return self._base

    def manifest_info(self) -> dict[str, Any]:
        """Fields for the checkpoint's manifest: the frozen base's record, readable without torch."""
        record = self.base_record()
        return {frozen.RECORD: record} if record is not None else {}

    def whole_state(self) -> dict[str, Any]:
        return {**self.state_dict(), **self.manifest_info()}

    def state_dict(self) -> dict[str, Any]:
        """``{"model": ..., "optimizer": ...}``, whole (without a frozen base); references, no copies."""
        model = frozen.trained_state(self.model) if self.frozen_base else unwrap(self.model).state_dict()
        return {"model": model, "optimizer": self.optimizer.state_dict()}

    def sharded_state_dict(self) -> dict[str, Any]:
        """Model and optimizer for DCP under the whole model's names, the optimizer flattened to one
        entry per name, so any split of the model (fsdp at any world size, pp x dp, one process) reads it."""
        model_sd, optim_sd = dcp_api().get_state_dict(self.model, self.optimizer, options=flat(self.model))
        return {"model": model_sd, "optimizer": optim_sd}

    def load(self, path: Path, manifest: dict[str, Any], replicated: dict[str, Any], group: Any) -> dict[str, Any]:
        """A whole checkpoint's model and optimizer (already read, its bytes straight into the live
        tensors), or a DCP checkpoint's (saved at any world size, by any split of the model)."""
        self.check_base(path, manifest, replicated)
        if "model" in replicated:
            agree(f"loading the model and optimizer of {path}", lambda: self.load_state_dict(
                {"model": replicated["model"], "optimizer": replicated["optimizer"]}, path))
        elif manifest_format(manifest) == DCP:
            self.load_sharded(str(path / SHARDED_DIR), group)  # DCP exchanges its own errors
        return {k: v for k, v in replicated.items() if k not in ("model", "optimizer", frozen.RECORD)}

    def check_base(self, path: Path, manifest: dict[str, Any], replicated: dict[str, Any]) -> None:
        """A frozen-base checkpoint resumes only on the base it was trained on (every rank alike,
        before its tensors are loaded): exit 2 otherwise."""
        record = manifest.get(frozen.RECORD) or replicated.get(frozen.RECORD)
        self.saved_base = record if isinstance(record, dict) else None
        if self.saved_base is None:
            return
        digest = frozen.base_digest(self.model) if self.frozen_base else None  # collectives: every rank

        def check() -> None:
            if digest is None:
                raise frozen.BaseMismatchError(
                    f"checkpoint {path} holds only the trained parameters of a frozen base (LoRA), but this model "
                    "freezes none; hint: build the model as the run did (its PEFT wrapping), or resume=never")
            frozen.check_base(self.model, self.saved_base, path, digest, also=", or resume=never to start over")

        agree(f"checking the frozen base of {path}", check)

    def load_state_dict(self, state: dict[str, Any], source: Any = None) -> None:
        """Whole (format=torch) model and optimizer state."""
        try:
            result = unwrap(self.model).load_state_dict(state["model"], strict=not self.frozen_base)
            frozen.missing_ok(self.model, list(result.missing_keys), list(result.unexpected_keys),
                              getattr(self, "saved_base", None), source)
            self.optimizer.load_state_dict(state["optimizer"])
        except (RuntimeError, ValueError, KeyError) as err:  # another model's checkpoint: bad input, not a bug
            raise _mismatch(source, err) from err

    def load_sharded(self, path: str, group: Any) -> None:
        """A format=dcp checkpoint (saved at any world size, by any split of the model)."""
        from hpctrain.parallel import dcp_read  # torch's DCP (DTensor, sympy) loads on first use

        api = dcp_api()
        # a frozen base is neither read nor set (strict off for it alone: DCP reads every trained name it is given)
        options = api.StateDictOptions(flatten_optimizer_state_dict=optimizer_flattened(path),
                                       ignore_frozen_params=self.frozen_base, strict=not self.frozen_base)
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
        """Bytes of the trained parameters and optimizer state on this rank (the checkpoint's size,
        for Young-Daly: a frozen base is not saved)."""
        tensors: list[torch.Tensor] = [p for p in self.model.parameters() if p.requires_grad or not self.frozen_base]
        for state in self.optimizer.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
        return sum(t.numel() * t.element_size() for t in tensors)

    def checked_module(self) -> nn.Module:
        return self.model

    @classmethod
    def export(cls, path: Path) -> Source:
        """The model of a whole-state checkpoint's replicated files, each file checked against its
        manifest entry (size and checksum) while it is read."""
        state = load_replicated(path, files=layout.read_manifest(path)["files"])
        if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
            raise layout.CheckpointError(f"{path / REPLICATED} holds no model state dict (crafted or corrupted)")
        return dict_source(dict(state["model"]))


class Zero1State(WholeState):
    """ZeRO-1: the optimizer state is split over the ranks; a save consolidates it on rank 0
    (a one-process optimizer's layout, so any world size, or ddp, resumes it; ZeRO-1 re-splits)."""

    def gather(self) -> None:
        super().gather()
        self.optimizer.consolidate_state_dict(to=0)  # type: ignore[attr-defined]  # ZeroRedundancyOptimizer

    def for_format(self, name: str) -> CheckpointView:
        view = super().for_format(name)
        if view is not self:
            view.before_save = self.gather  # type: ignore[attr-defined]  # consolidated before DCP saves too
        return view


class ShardedState(WholeState):
    """FSDP / tensor parallel: this rank's shards, saved through DCP under the whole model's names
    (format=dcp: every rank writes its own files of ``sharded/``)."""

    format = DCP
    files_dir = SHARDED_DIR
    reads = (WHOLE,)

    def whole_state(self) -> dict[str, Any]:
        return self.manifest_info()  # the frozen base's record, if any: the tensors go to DCP's files

    def own_state(self) -> dict[str, Any]:
        return self.sharded_state_dict()

    def write(self, state: Any, directory: Path, rank: int, group: Any) -> list[Path]:
        """DCP's save (a collective over ``group``) into ``directory/sharded``: this rank's
        ``__<rank>_*`` files, and rank 0's ``.metadata``."""
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        target = directory / SHARDED_DIR
        target.mkdir(parents=True, exist_ok=True)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(target), sync_files=True), process_group=group,
                 no_dist=group is None and not dist.is_initialized())
        mine = [p for p in target.iterdir() if p.name.startswith(f"__{rank}_")]
        if rank == 0:
            mine += [p for p in target.iterdir() if p.name == ".metadata"]
        return sorted(mine)

    def load(self, path: Path, manifest: dict[str, Any], replicated: dict[str, Any], group: Any) -> dict[str, Any]:
        if "model" in replicated:  # a whole checkpoint (e.g. DDP's) resumed under FSDP
            agree(f"loading the whole state of {path} into this rank's shards", lambda: self.load_state_dict(
                {"model": replicated["model"], "optimizer": replicated["optimizer"]}, path))
            return {k: v for k, v in replicated.items() if k not in ("model", "optimizer")}
        return super().load(path, manifest, replicated, group)

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
            if self.frozen_base:  # strict below is off: a frozen-base checkpoint may lack the base, nothing else
                loaded = {frozen.clean_name(k) for k in state["model"]}
                missing = [n for n in frozen.trained_state(self.model) if frozen.clean_name(n) not in loaded]
                frozen.missing_ok(self.model, missing, [], getattr(self, "saved_base", None), source)
            api.set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=optim,
                               options=api.StateDictOptions(full_state_dict=True, strict=not self.frozen_base))
        except (RuntimeError, ValueError, KeyError, IndexError) as err:  # another model's checkpoint: bad input
            raise _mismatch(source, err) from err

    def live_tensors(self) -> dict[str, torch.Tensor] | None:
        return None  # shards: a whole checkpoint is read into memory, then split (load_state_dict)

    @classmethod
    def check_files(cls, path: Path, names: set[str] | None = None) -> None:
        """DCP's ``.metadata`` is a pickle that a consistent manifest does not make harmless: read it
        with only DCP's own classes admitted, then check the items (each a torch.save zip) of the
        files ``names`` (None: all) against safe_pickle's limits; a refusal makes the checkpoint
        corrupt (skipped by ``resume=auto``), never code that runs."""
        if names is not None and not (path / SHARDED_DIR / ".metadata").exists():
            return  # not listed (crafted): the checksums of the listed files said so already, or DCP will
        items = None if names is None else {n.split("/", 1)[1] for n in names if n.startswith(f"{SHARDED_DIR}/")}
        check_dcp_metadata(path / SHARDED_DIR, items)

    @classmethod
    def export(cls, path: Path) -> Source:
        """The model tensors of the DCP files, one at a time (never the optimizer state)."""
        return dcp_source(path / SHARDED_DIR)


class _DcpOf(ShardedState):
    """A whole model saved through DCP (``checkpoint.format=dcp``), loaded as a whole model: a
    whole checkpoint's bytes go straight into its live tensors."""

    whole: WholeState

    def load(self, path: Path, manifest: dict[str, Any], replicated: dict[str, Any], group: Any) -> dict[str, Any]:
        return self.whole.load(path, manifest, replicated, group)

    def load_state_dict(self, state: dict[str, Any], source: Any = None) -> None:
        self.whole.load_state_dict(state, source)

    def live_tensors(self) -> dict[str, torch.Tensor] | None:
        return self.whole.live_tensors()


# registered where they are defined, so a live view's module brings its formats (by class: the
# by-path lines for torch-free commands are hpctrain.parallel.checkpoint_formats)
register_format(WHOLE, WholeState, default=True)
register_format(DCP, ShardedState)


def check_dcp_metadata(path: Path, items: set[str] | None = None) -> None:
    """DCP's ``.metadata`` of the directory ``path`` read with only DCP's classes admitted, and
    the items of its files named in ``items`` (None: all) checked: a refusal is a
    :class:`~hpctrain.checkpoint.layout.CheckpointError`, an unreadable file an
    :class:`~hpctrain.checkpoint.layout.UnreadableCheckpointError`."""
    from hpctrain.parallel import dcp_read  # torch's DCP (DTensor, sympy) loads on first use

    try:
        dcp_read.check_items(path, dcp_read.read_metadata(path), items)
    except UnsafePickleError as err:
        raise layout.CheckpointError(str(err)) from err
    except OSError as err:
        raise layout.unreadable(Path(err.filename) if err.filename else path / ".metadata", err) from err


def dcp_source(path: Path, prefix: str = "model.") -> Source:
    """The model tensors of a DCP checkpoint directory, read one at a time without a process
    group (``no_dist``): the metadata lists them; the optimizer state is never read."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from hpctrain.parallel import dcp_read  # torch's DCP (DTensor, sympy) loads on first use

    metadata = dcp_read.read_metadata(path)
    specs = sorted(TensorSpec(key[len(prefix):], meta.properties.dtype, tuple(meta.size))
                   for key, meta in metadata.state_dict_metadata.items()
                   if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata))
    live = LiveBytes()

    def tensors() -> Iterator[torch.Tensor]:
        for spec in specs:
            tensor = live.track(torch.empty(spec.shape, dtype=spec.dtype))
            with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp_read.load({prefix + spec.name: tensor}, path, no_dist=True)
            yield tensor
            del tensor

    return Source(specs, tensors(), live)


def optimizer_flattened(path: str) -> bool:
    """Did the save flatten the optimizer (``optimizer.param_groups.<name>.<key>`` entries)?
    Checkpoints written before it was saved flattened load too."""
    from hpctrain.parallel import dcp_read  # torch's DCP (DTensor, sympy) loads on first use

    names = dcp_read.read_metadata(path).state_dict_metadata
    return any(name.startswith("optimizer.param_groups.") for name in names)
