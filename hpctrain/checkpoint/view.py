"""The checkpoint-view protocol: how model + optimizer reach the disk, one class per on-disk format.

The checkpointer (commit protocol, checksums, retention, schedule, agreement) saves a mapping
of ``Stateful`` objects and knows no strategy and no format. The entry for model + optimizer
is a :class:`CheckpointView`, made by the strategy that holds them; it says what a save writes
(whole tensors into the replicated files that rank 0 writes, or files of its own under a
subdirectory, every rank its share) and how a checkpoint is put back, at this layout or
another. The same class answers the questions that need no live model: which of a
checkpoint's files are its own, whether they are safe to read, and the whole model's tensors
for ``hpctrain ckpt export``.

A manifest's ``format`` names the class that wrote it, through the registry::

    register_format("myformat", "mypackage.ckpt:MyView")   # name -> class, imported on first use

so a new on-disk format is one subclass plus one registry line. hpctrain's own formats are
registered by the parallel layer (:mod:`hpctrain.parallel.checkpoint_formats`), where the
strategies are: nothing in ``hpctrain/checkpoint/`` names a strategy or a format.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar

from hpctrain.checkpoint.confine import CheckpointError
from hpctrain.core.errors import UserError


class StrategyMismatchError(UserError):
    """A checkpoint whose format the running strategy's view cannot load (a DeepSpeed checkpoint
    resumed without DeepSpeed, or another checkpoint resumed under it)."""


class UnknownFormatError(UserError, CheckpointError):
    """A manifest names a format no view is registered for: exit 2."""


class CheckpointView(ABC):
    """Model + optimizer as one on-disk format saves and loads them.

    Saving (every rank, at a step boundary): :meth:`gather`, then rank 0's :meth:`whole_state`
    goes into the replicated files with the rest of the state, and every rank's
    :meth:`own_state` is handed to :meth:`write` (in the writer thread under
    ``checkpoint.mode=async`` when :attr:`background`, its tensors first copied to CPU), which
    writes this rank's files under the checkpoint directory; the writer fsyncs and hashes them
    into the manifest. Resuming: :meth:`check_resume` (bad input is raised before anything is
    read), the replicated files (read straight into :meth:`live_tensors` where given), the
    view's own files hashed and :meth:`check_files` before anyone reads them, then
    :meth:`load`.
    """

    format: ClassVar[str] = ""
    """What a save writes: the manifest's ``format``, the registry's key."""
    files_dir: ClassVar[str | None] = None
    """The checkpoint subdirectory this format's own files live in; None: model + optimizer go
    whole into the replicated files."""
    reads: ClassVar[tuple[str, ...]] = ()
    """Formats :meth:`load` reads besides its own (another layout's checkpoints)."""
    written_by: ClassVar[str] = "the strategy that wrote it"
    """Who writes this format, for the hint when another strategy tries to resume it."""
    background: ClassVar[bool] = True
    """May :meth:`write` run in the async writer thread? False when it runs collectives on the
    training process group (then every save is synchronous)."""

    strategy: str = "?"
    """The strategy that made this view (named in messages)."""
    optimizer: Any = None
    """The optimizer whose ``step()`` the async writer waits for before it changes what is staged."""

    # ---------------------------------------------------------------- choosing the format

    def for_format(self, name: str) -> CheckpointView:
        """The view of the same state that saves in ``name`` (``checkpoint.format``) where this
        state can be saved that way; else this view (the strategy's format wins)."""
        return self

    # ---------------------------------------------------------------- saving

    def manifest_info(self) -> dict[str, Any]:
        """Fields of this state for the checkpoint's manifest, readable without torch (a frozen
        base's digest, say); default none."""
        return {}

    def gather(self) -> None:  # noqa: B027 - an optional step: most views need none
        """Before every save, on every rank (collectives allowed): make the state consistent
        (buffers made rank 0's, a split optimizer consolidated)."""

    def whole_state(self) -> dict[str, Any]:
        """Rank 0: entries (``model``, ``optimizer``) for the replicated files; references, no
        copies. Empty where this format writes files of its own."""
        return {}

    def own_state(self) -> Any:
        """Every rank: what :meth:`write` writes (its tensors may be copied to CPU first); None: nothing."""
        return None

    def write(self, state: Any, directory: Path, rank: int, group: Any) -> list[Path]:
        """Write this rank's own files of ``state`` under ``directory`` (the checkpoint's partial
        directory); returns the files this rank wrote (every rank calls it, a collective allowed)."""
        return []

    def step_storages(self) -> set[int]:
        """Storages (``data_ptr``) only ``optimizer.step()`` changes: async saves copy them while
        the next forward/backward runs."""
        return set()

    @abstractmethod
    def nbytes(self) -> int:
        """Bytes of model and optimizer state on this rank (the save's size, for Young-Daly)."""

    def checked_module(self) -> Any:
        """The ``nn.Module`` whose parameters and buffers must be finite before a save (None: none)."""
        return None

    # ---------------------------------------------------------------- resuming

    def live_tensors(self) -> dict[str, Any] | None:
        """The model's live tensors by state-dict name, for a whole-state checkpoint to be read
        straight into (None: read into memory, then :meth:`load`)."""
        return None

    def check_resume(self, path: Path, manifest: dict[str, Any], world_size: int) -> None:
        """Raise a :class:`~hpctrain.core.errors.UserError` if this view cannot load the checkpoint
        at ``path`` (its format, or the world size that wrote it): every rank alike, before
        anything is read. Default: its own format and :attr:`reads`."""
        fmt = manifest_format(manifest)
        if fmt != self.format and fmt not in self.reads:
            writer = view_class(fmt)  # a format nobody registered: UnknownFormatError, a crafted or foreign manifest
            raise StrategyMismatchError(
                f"checkpoint {path} has format={fmt} and cannot resume under parallel.strategy={self.strategy}; "
                f"hint: resume with the strategy that wrote it ({writer.written_by}), or export its "
                f"weights (`hpctrain ckpt export {path} model.pt`) and start a new run from them")

    @abstractmethod
    def load(self, path: Path, manifest: dict[str, Any], replicated: dict[str, Any], group: Any) -> dict[str, Any]:
        """Put model + optimizer of the checkpoint at ``path`` back (every rank; ``replicated``:
        the replicated state already read, ``group``: the checkpoint's gloo group). Returns
        ``replicated`` without the entries it consumed; the checkpointer restores the rest."""

    # ---------------------------------------------------------------- without a live model

    @classmethod
    def own_files(cls, names: Iterable[str]) -> list[str]:
        """This format's own files among a manifest's names (sorted), hashed before they are read."""
        if cls.files_dir is None:
            return []
        return sorted(n for n in names if n.startswith(f"{cls.files_dir}/"))

    @classmethod  # noqa: B027 - optional: a format whose files need no check beyond their checksums
    def check_files(cls, path: Path, names: set[str] | None = None) -> None:
        """Check what this format reads without a checksum's help (a pickle, a header) among its
        own files ``names`` of the checkpoint at ``path`` (None: all), before anything reads them;
        raise :class:`~hpctrain.checkpoint.confine.CheckpointError` for a crafted one."""

    @classmethod
    @abstractmethod
    def export(cls, path: Path) -> Any:
        """The whole model's tensors of the committed, verified checkpoint at ``path``, without a
        process group: a :class:`hpctrain.weights.export.Source` (``hpctrain ckpt export``)."""


# ---------------------------------------------------------------- the registry

_FORMATS: dict[str, type[CheckpointView] | str] = {}
_DEFAULT: list[str] = []  # the format of manifests that name none (written before formats had names)


def register_format(name: str, view: type[CheckpointView] | str, *, default: bool = False) -> None:
    """Register the view class that writes and reads format ``name``: a class, or its import
    path ``"package.module:Class"`` (imported on first use, so a torch-free command can list
    formats). ``default``: the format of manifests that name none."""
    _FORMATS[name] = view
    if default:
        _DEFAULT[:] = [name]


def formats() -> list[str]:
    """The registered format names."""
    return sorted(_FORMATS)


def manifest_format(manifest: dict[str, Any]) -> str:
    """The format a manifest names (the default format where it names none)."""
    fmt = manifest.get("format")
    if fmt is None and _DEFAULT:
        return _DEFAULT[0]
    return str(fmt)


def view_class(name: str) -> type[CheckpointView]:
    """The view class registered for format ``name`` (imported now if registered by path)."""
    entry = _FORMATS.get(name)
    if entry is None:
        known = ", ".join(formats()) or "none"
        raise UnknownFormatError(f"checkpoint format {name!r} has no registered view (registered: {known}); hint: "
                                 "import the module that registers it (hpctrain.checkpoint.view.register_format), "
                                 "or use the hpctrain version that wrote the checkpoint")
    if isinstance(entry, str):
        module, _, attr = entry.partition(":")
        entry = getattr(importlib.import_module(module), attr)
        if not (isinstance(entry, type) and issubclass(entry, CheckpointView)):
            raise TypeError(f"checkpoint format {name!r}: {_FORMATS[name]} is not a CheckpointView class")
        _FORMATS[name] = entry
    return entry
