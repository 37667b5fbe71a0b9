"""One consolidated weights file (``model.pt``, ``hpctrain ckpt export``) written one tensor at
a time: no rank ever holds more than one whole tensor of a sharded model.

A *source* is the names, dtypes and shapes of the tensors (known on every rank up front:
DTensor shapes are global, DCP's metadata lists them) in sorted-name order, plus an iterator
that yields the tensors in that order: rank 0 gets each whole tensor, the other ranks
``None`` (they take part in the collective that gathers it). :func:`write_stream` writes
them as they come:

- ``.safetensors``: the header (names, dtypes, shapes, offsets) first, then the bytes;
- ``.pt``: torch's own zip format written record by record with ``torch._C.PyTorchFileWriter``,
  as ``torch.save`` lays it out for a ``{name: tensor}`` dict (``data.pkl`` pickled from the
  specs, referencing each storage by key, then ``data/<key>`` as each tensor arrives), so
  ``torch.load(path, weights_only=True)`` and ``mmap=True`` read it unchanged.

:class:`LiveBytes` counts the gathered bytes alive at once (a tensor counts until it is garbage
collected); tests assert its peak stays within the largest single tensor.
"""

from __future__ import annotations

import collections
import io
import math
import pickle
import sys
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from hpctrain.checkpoint import layout, tensorfile
from hpctrain.core.atomic import atomic_open
from hpctrain.core.errors import RunError, UserError
from hpctrain.core.modules import is_dtensor, unwrap
from hpctrain.weights.digest import ParamsHash, clean_name

SUFFIXES = (".pt", ".safetensors")


class ExportError(RunError):
    """The consolidated file could not be written; the message names it."""


class ExportFormatError(UserError):
    """The output file's suffix names no format this writer knows."""


@dataclass(frozen=True, order=True)
class TensorSpec:
    """What a tensor of the file is, before it exists."""

    name: str
    dtype: torch.dtype = field(compare=False)
    shape: tuple[int, ...] = field(compare=False)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


class LiveBytes:
    """Bytes of gathered (newly allocated) tensors alive at once, and the peak: a tensor counts
    from :meth:`track` until Python frees it, so a caller that keeps tensors shows up here."""

    def __init__(self) -> None:
        self.current = 0
        self.peak = 0

    def track(self, tensor: torch.Tensor) -> torch.Tensor:
        nbytes = tensor.numel() * tensor.element_size()
        self.current += nbytes
        self.peak = max(self.peak, self.current)
        weakref.finalize(tensor, self._free, nbytes)
        return tensor

    def _free(self, nbytes: int) -> None:
        self.current -= nbytes


@dataclass
class Source:
    """The tensors of one consolidated file: ``specs`` in sorted-name order, and ``tensors``
    yielding each (rank 0) or ``None`` (other ranks) in that order; ``live`` counts gathered bytes."""

    specs: list[TensorSpec]
    tensors: Iterator[torch.Tensor | None]
    live: LiveBytes


@dataclass(frozen=True)
class Written:
    path: Path
    tensors: int
    nbytes: int
    params_sha256: str | None  # of the parameters named to write_stream, in sorted-name order


# ---------------------------------------------------------------- writers


class _Writer(Protocol):
    def add(self, index: int, tensor: torch.Tensor) -> None: ...

    def close(self) -> None: ...


class _SafetensorsWriter:
    """safetensors (tensorfile's layout: the data starts 4 KiB-aligned), header first."""

    def __init__(self, fh: Any, specs: list[TensorSpec]) -> None:
        self._fh = fh
        header, _ = tensorfile.header((s.name, s.dtype, s.shape) for s in specs)
        fh.write(header)

    def add(self, index: int, tensor: torch.Tensor) -> None:
        self._fh.write(tensorfile.tensor_bytes(tensor))

    def close(self) -> None:
        pass


class _StorageRef:
    """Stands in for a storage in ``data.pkl``; pickled by key as torch.save's persistent ids."""

    def __init__(self, key: str, dtype: torch.dtype, numel: int) -> None:
        self.key, self.dtype, self.numel = key, dtype, numel


class _TensorRef:
    """Pickles as torch pickles a contiguous CPU tensor: ``_rebuild_tensor_v2`` of its storage."""

    def __init__(self, storage: _StorageRef, shape: tuple[int, ...]) -> None:
        self.storage, self.shape = storage, shape

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        hooks: collections.OrderedDict[Any, Any] = collections.OrderedDict()  # backward hooks: none
        strides = torch.empty(self.shape, device="meta").stride()  # contiguous, as torch.save writes them
        args = (self.storage, 0, self.shape, strides, False, hooks)
        return torch._utils._rebuild_tensor_v2, args


class _Pickler(pickle.Pickler):
    _TYPES = torch.storage._dtype_to_storage_type_map()

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _StorageRef):  # torch.save's tuple: typed storage class, key, location, numel
            return "storage", getattr(torch, self._TYPES[obj.dtype]), obj.key, "cpu", obj.numel
        return None


class _TorchZipWriter:
    """``torch.save({name: tensor})``'s zip records, with ``data/<i>`` written as tensor i arrives.
    A file object (not a path) names the archive ``archive/`` as torch.save into a buffer does,
    so the bytes do not depend on the (temporary) file name."""

    def __init__(self, fh: Any, specs: list[TensorSpec]) -> None:
        for spec in specs:
            if spec.dtype not in _Pickler._TYPES:
                raise ExportError(f"tensor {spec.name!r} has dtype {spec.dtype}, which .pt export does not store")
        self._zip = torch._C.PyTorchFileWriter(fh)
        try:
            self._start(specs)
        except BaseException:
            self._zip.write_end_of_file()  # never left for its destructor, which would write to a closed file
            raise

    def _start(self, specs: list[TensorSpec]) -> None:
        buf = io.BytesIO()
        _Pickler(buf, protocol=2).dump({s.name: _TensorRef(_StorageRef(str(i), s.dtype, math.prod(s.shape)), s.shape)
                                        for i, s in enumerate(specs)})
        pkl = buf.getvalue()
        self._record("data.pkl", pkl)
        self._record(".format_version", b"1")  # storages numbered by key, as torch.save writes
        self._record(".storage_alignment", str(torch.serialization._get_storage_alignment()).encode())
        self._record("byteorder", sys.byteorder.encode())

    def _record(self, name: str, data: bytes) -> None:
        self._zip.write_record(name, data, len(data))

    def add(self, index: int, tensor: torch.Tensor) -> None:
        tight = tensor.storage_offset() == 0 and tensor.is_contiguous() and \
            tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
        storage: Any = (tensor if tight else tensor.contiguous().clone()).untyped_storage()
        self._zip.write_record(f"data/{index}", storage, storage.nbytes())

    def close(self) -> None:
        self._zip.write_end_of_file()


def check_suffix(path: Path) -> None:
    if path.suffix not in SUFFIXES:
        raise ExportFormatError(f"{path} must end in .pt or .safetensors (the format is taken from the suffix)")


def _open(fh: Any, path: Path, specs: list[TensorSpec]) -> _Writer:
    return _SafetensorsWriter(fh, specs) if path.suffix == ".safetensors" else _TorchZipWriter(fh, specs)


def write_stream(path: Path, source: Source, *, write: bool = True,
                 param_names: Iterable[str] | None = None) -> Written | None:
    """Consume ``source`` (every rank: the iterator runs the gathering collectives) and, where
    ``write`` (rank 0), write its tensors to ``path`` atomically as they arrive, hashing the
    ``param_names`` among them (see :class:`hpctrain.weights.digest.ParamsHash`). A write error stops
    the writing, not the gathering: the other ranks finish their collectives, then it is raised."""
    if not write:
        _drain(source)
        return None
    try:
        check_suffix(path)  # bad input (exit 2), before any file is made
    except ExportFormatError:
        _drain(source)
        raise
    hasher = ParamsHash(param_names) if param_names is not None else None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        layout.remove_stale_temps(path.parent, path.name)  # a killed earlier write's .NAME.tmp-PID
        with atomic_open(path, "wb") as fh:
            error = _write_all(fh, path, source, hasher)
            if error is not None:
                raise ExportError(f"cannot write {path}: {error}") from error
    except OSError as err:  # the folder or file cannot be made: the other ranks' collectives still run
        _drain(source)
        raise ExportError(f"cannot write {path}: {err}; hint: check the folder exists, is writable and has space") \
            from err
    return Written(path, len(source.specs), sum(s.nbytes for s in source.specs),
                   hasher.hexdigest() if hasher else None)


def _drain(source: Source) -> None:
    for tensor in source.tensors:
        del tensor  # not kept while the next one is gathered


def _write_all(fh: Any, path: Path, source: Source, hasher: ParamsHash | None) -> BaseException | None:
    writer: _Writer | None = None
    error: BaseException | None = None
    try:
        writer = _open(fh, path, source.specs)
    except Exception as err:  # noqa: BLE001 - raised once every tensor is consumed
        error = err
    # next() by hand: zip/enumerate keep their last tuple (and its tensor) alive while fetching the next
    for index, spec in enumerate(source.specs):
        tensor = next(source.tensors, None)
        if error is None and writer is not None:
            try:
                _check(spec, tensor)
                writer.add(index, tensor)  # type: ignore[arg-type]  # _check: a tensor
                if hasher is not None:
                    hasher.update(spec.name, tensor)  # type: ignore[arg-type]
            except Exception as err:  # noqa: BLE001 - raised once every tensor is consumed
                error = err
        del tensor  # before the next one is gathered: one whole tensor alive at a time
    if next(source.tensors, None) is not None:
        error = error or ExportError(f"more tensors came than the {len(source.specs)} announced")
    if writer is not None:
        try:  # also after an error: torch's zip writer must end while the file is open (else it aborts later)
            writer.close()
        except Exception as err:  # noqa: BLE001 - returned to the caller, which raises it
            error = error or err
    return error


def _check(spec: TensorSpec, tensor: torch.Tensor | None) -> None:
    if tensor is None or tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
        got = "nothing" if tensor is None else f"{tensor.dtype} {list(tensor.shape)}"
        raise ExportError(f"tensor {spec.name!r}: expected {spec.dtype} {list(spec.shape)}, got {got}")


# ---------------------------------------------------------------- sources


def save_model(model: nn.Module | dict[str, torch.Tensor], path: Path) -> None:
    """A model's state dict (or a whole one) as one consolidated file (``.pt`` or ``.safetensors``),
    written tensor by tensor."""
    state = model.state_dict() if isinstance(model, nn.Module) else model
    write_stream(path, dict_source(state))


def dict_source(state: dict[str, torch.Tensor]) -> Source:
    """Whole tensors already in memory (one process, DDP, DeepSpeed's own gather), by clean name."""
    named = sorted((clean_name(k), v) for k, v in state.items() if isinstance(v, torch.Tensor))
    specs = [TensorSpec(name, v.dtype, tuple(v.shape)) for name, v in named]
    return Source(specs, (v.detach().cpu() for _, v in named), LiveBytes())


def model_source(model: nn.Module, *, is_main: bool) -> Source:
    """A model on every rank, whole (DDP, ZeRO-1) or sharded (FSDP, HSDP, tensor parallel): each
    DTensor is gathered alone (``full_tensor``, a collective every rank joins) and dropped right
    after rank 0 has written it. Every rank calls it and consumes the tensors."""
    named = sorted((clean_name(k), v) for k, v in unwrap(model).state_dict().items() if isinstance(v, torch.Tensor))
    _check_unique([name for name, _ in named])
    specs = [TensorSpec(name, v.dtype, tuple(v.shape)) for name, v in named]
    live = LiveBytes()
    return Source(specs, _gathered((v for _, v in named), is_main, live), live)


def _gathered(values: Iterable[torch.Tensor], is_main: bool, live: LiveBytes) -> Iterator[torch.Tensor | None]:
    for value in values:
        out = _whole(value.detach(), is_main, live)
        yield out
        del out  # not kept while the next one is gathered


def _whole(value: torch.Tensor, is_main: bool, live: LiveBytes) -> torch.Tensor | None:
    if is_dtensor(value):
        mesh_device = value.device_mesh.device_type
        # CPU-offloaded shards: the collective runs on the mesh's device
        on_mesh: Any = value.to(mesh_device) if value.device.type != mesh_device else value
        full = on_mesh.full_tensor()
        return live.track(full.cpu()) if is_main else None
    if not is_main:
        return None
    return live.track(value.cpu()) if value.device.type != "cpu" else value


def pipeline_source(state: dict[str, torch.Tensor], *, sender: bool, rank: int, device: torch.device) -> Source:
    """Pipeline stages: ``state`` is this rank's stage(s) under the whole model's names (live
    tensors; DTensor shards when FSDP runs over the stage's dp group). One replica of each stage
    (``sender``) owns its names; for each name in sorted order the stage's ranks gather that one
    tensor (``full_tensor`` over their dp group) and the owner sends it to rank 0 alone
    (send/recv). Every rank calls it (``rank``: global; ``device``: where collectives run)."""
    import torch.distributed as dist

    mine = {clean_name(k): v.detach() for k, v in state.items() if isinstance(v, torch.Tensor)}
    tables: list[Any] = [None] * dist.get_world_size()
    rows = [(name, rank, v.dtype, tuple(v.shape)) for name, v in mine.items()] if sender else []
    dist.all_gather_object(tables, rows)
    table = sorted(row for rank_rows in tables for row in rank_rows)
    _check_unique([row[0] for row in table])
    specs = [TensorSpec(name, dtype, shape) for name, _, dtype, shape in table]
    live = LiveBytes()
    owners = [owner for _, owner, _, _ in table]
    return Source(specs, _sent(specs, owners, mine, rank=rank, device=device, live=live), live)


def _sent(specs: list[TensorSpec], owners: list[int], mine: dict[str, torch.Tensor], *, rank: int,
          device: torch.device, live: LiveBytes) -> Iterator[torch.Tensor | None]:
    import torch.distributed as dist

    for spec, owner in zip(specs, owners, strict=True):
        # the stage's ranks gather the tensor (rank 0 keeps it when it owns it)
        whole = _whole(mine[spec.name], rank == owner, live) if spec.name in mine else None
        out: torch.Tensor | None = None
        if rank == owner == 0:
            out = whole
        elif rank == owner:
            dist.send(whole.to(device).contiguous(), dst=0)  # type: ignore[union-attr]  # the owner gathered it
        elif rank == 0:
            buf = torch.empty(spec.shape, dtype=spec.dtype, device=device)
            dist.recv(buf, src=owner)
            out = live.track(buf.cpu() if buf.device.type != "cpu" else buf)
            del buf
        del whole
        yield out
        del out


def _check_unique(names: list[str]) -> None:
    seen: set[str] = set()
    doubled = sorted({n for n in names if n in seen or seen.add(n)})  # type: ignore[func-returns-value]
    if doubled:
        raise ExportError(f"tensor names occur twice in the consolidated state: {', '.join(doubled[:5])}")
