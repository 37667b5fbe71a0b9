"""The run directory: config.yaml, metrics.jsonl, model.pt, summary.json.

metrics.jsonl is written by :class:`hpctrain.telemetry.loggers.JsonlLogger` (``telemetry.loggers``).

Files are written whole or not at all (temporary name, fsync, rename), and a finished
run is never overwritten unless ``run.overwrite=true``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from hpctrain.errors import RunError, UserError, agree, describe, io_message

if TYPE_CHECKING:  # only the hashing helpers touch tensors; `hpctrain slurm` writes its script here without torch
    import torch
    from torch import nn

    from hpctrain.run_lock import RunDirLock

log = logging.getLogger("hpctrain")

SUMMARY = "summary.json"
CHECKPOINTS = "checkpoints"


class RunDirError(UserError):
    """The run directory cannot be used; the message says why and what to do."""


class _OneComponent:
    """A config section whose text values read as one path component: ``data.name=csv:data/x.csv``
    names ``runs/csv-data-x.csv-...``, not a folder ``csv:data`` with an ``x.csv-...`` inside."""

    def __init__(self, section: Any) -> None:
        self._section = section

    def __getattr__(self, name: str) -> Any:
        return _one_component(getattr(self._section, name))


def _one_component(value: Any) -> Any:
    if isinstance(value, str):
        return re.sub(r"[^\w.+-]+", "-", value).strip("-")
    return value if isinstance(value, (int, float, bool)) or value is None else _OneComponent(value)


def resolve_run_dir(template: str, cfg: Any) -> Path:
    """``run.dir`` may name config values: ``runs/{data.name}-{model.name}``."""
    sections = {name: _one_component(getattr(cfg, name)) for name in vars(cfg)}
    try:
        return Path(template.format(**sections))
    except (KeyError, AttributeError, IndexError, ValueError) as err:
        raise RunDirError(f"run.dir={template!r} names an unknown config key ({err})") from None


def prepare_run_dir(path: Path, overwrite: bool, resume: str = "never") -> None:
    """Create the directory; refuse to reuse one that holds a finished run.

    An unfinished run (checkpoints, no summary.json) is continued by ``resume=auto``; with
    ``resume=never`` it is only replaced under ``run.overwrite=true``. Replacing a run removes
    its checkpoints, so two runs never mix."""
    if check_run_dir(path, overwrite, resume):
        _remove_old_checkpoints(path / CHECKPOINTS)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise RunDirError(f"cannot create run.dir {path}: {err}") from err


def check_run_dir(path: Path, overwrite: bool, resume: str = "never") -> bool:
    """The read-only part of :func:`prepare_run_dir`, safe on every rank before the process
    group exists (so all ranks fail alike instead of waiting for rank 0). Returns whether
    old checkpoints are to be removed."""
    finished = (path / SUMMARY).exists()
    if finished and not overwrite:
        what = "nothing to resume" if resume != "never" else "it would be overwritten"
        raise RunDirError(
            f"run.dir {path} already holds a finished run ({SUMMARY}): {what}; hint: choose another run.dir, "
            "or pass run.overwrite=true to replace its outputs"
        )
    checkpoints = path / CHECKPOINTS
    # run.overwrite never discards an unfinished run that resume=auto would continue: a
    # requeued job carrying overwrite=true must not lose its checkpoints on every restart.
    if checkpoints.is_dir() and _has_entries(checkpoints) and (finished or resume == "never"):
        if not overwrite:
            raise RunDirError(
                f"run.dir {path} holds checkpoints of an unfinished run; hint: resume=auto continues it, "
                "run.overwrite=true starts over"
            )
        return True
    return False


def _has_entries(folder: Path) -> bool:
    try:
        return any(folder.iterdir())
    except OSError as err:  # unreadable is not empty, and not corrupt: its checkpoints may be all there is
        raise RunDirError(io_message("list", folder, err)) from err


def _remove_old_checkpoints(checkpoints: Path) -> None:
    # Rename first, so a crash half-way never leaves a mix that resume=auto would read.
    trash = checkpoints.with_name(f".{CHECKPOINTS}.old-{os.getpid()}")
    try:
        os.replace(checkpoints, trash)
        fsync_dir(checkpoints.parent)
        shutil.rmtree(trash)
    except OSError as err:
        raise RunDirError(f"run.overwrite=true: cannot remove the old {checkpoints}: {err}") from err


def fsync_dir(path: Path) -> None:
    """Make a rename (or a new name) in ``path`` durable: without it a power loss after
    ``os.replace`` may bring the old name back. Every atomic writer calls it."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_durably(tmp: Path, path: Path) -> None:
    """``os.replace(tmp, path)`` and fsync of the parent directory."""
    os.replace(tmp, path)
    fsync_dir(path.parent)


@contextmanager
def atomic_open(path: Path, mode: str = "w") -> Iterator[IO[Any]]:
    """A file that appears under ``path`` whole or not at all: written to a temporary
    name beside it, flushed, fsynced, renamed, parent directory fsynced. On an error the
    temporary file is removed and ``path`` is untouched."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, mode) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        replace_durably(tmp, path)
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        if isinstance(err, OSError) and err.filename is None:
            err.filename = str(path)  # a failed write() or fsync() names no file: name the one it was for
        raise


def atomic_write_bytes(path: Path, data: bytes) -> None:
    with atomic_open(path, "wb") as fh:
        fh.write(data)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def write_json(path: Path, data: dict[str, Any]) -> None:
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


# Wrappers that insert a module level: activation checkpointing, torch.compile (their state
# dicts drop it; named_parameters keeps it).
_WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.")


def clean_name(name: str) -> str:
    """A parameter's name in the user's model, without the wrappers' module levels."""
    for wrapper in _WRAPPERS:
        name = name.replace(wrapper, "")
    return name


def param_names(model: nn.Module) -> list[str]:
    """The model's parameter names (shared parameters once, by their first name), unwrapped."""
    return [clean_name(name) for name, _ in model.named_parameters()]


class ParamsHash:
    """:func:`params_sha256` fed one tensor at a time, in sorted-name order (the order a
    streamed model.pt is written in); names not among the parameters (buffers, a tied
    weight's second name) are skipped. A missing parameter or an out-of-order one is a bug
    of the caller and raises."""

    def __init__(self, names: Iterable[str]) -> None:
        self._names = sorted(set(names))
        self._wanted = set(self._names)
        self._done = 0
        self._digest = hashlib.sha256()

    def update(self, name: str, tensor: torch.Tensor) -> None:
        if name not in self._wanted:
            return
        if self._done >= len(self._names) or self._names[self._done] != name:
            raise RunError(f"params_sha256: parameter {name!r} came out of sorted-name order")
        import torch  # loaded already: the caller holds a tensor

        self._done += 1
        self._digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())

    def hexdigest(self) -> str:
        if self._done != len(self._names):
            missing = ", ".join(self._names[self._done:][:3])
            raise RunError(f"params_sha256: {len(self._names) - self._done} parameters never came ({missing}, ...)")
        return self._digest.hexdigest()


def params_sha256(model: nn.Module, full: dict[str, torch.Tensor] | None = None) -> str:
    """sha256 of every parameter's bytes, in sorted name order: equal hashes = equal weights.
    ``full``: the whole tensors by (unwrapped) name, when ``model`` holds shards."""
    # Wrappers insert one uniform level below a common prefix, so sorting the wrapped names
    # and sorting the unwrapped ones give the same order (ParamsHash sorts the unwrapped).
    params = dict(model.named_parameters())
    digest = ParamsHash(clean_name(name) for name in params)
    for name, param in sorted(params.items(), key=lambda item: clean_name(item[0])):
        digest.update(clean_name(name), param if full is None else full[clean_name(name)])
    return digest.hexdigest()


def prepare_run_dir_together(path: Path, overwrite: bool, resume: str, is_main: bool,
                             lock: RunDirLock | None = None) -> None:
    """:func:`prepare_run_dir` once the process group exists: rank 0 alone changes the
    directory (``run.overwrite=true`` renames ``checkpoints/`` away) while the other ranks
    wait for its outcome, so no rank lists ``checkpoints/`` during the rename, and rank 0's
    error fails every rank with the same message. Every rank calls it. Rank 0 takes ``lock``
    first: nothing is changed in a directory another live run holds."""
    agree("preparing run.dir", lambda: _prepare_locked(path, overwrite, resume, lock) if is_main else None)


def _prepare_locked(path: Path, overwrite: bool, resume: str, lock: RunDirLock | None) -> None:
    if lock is not None:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise RunDirError(f"cannot create run.dir {path}: {err}") from err
        try:
            lock.acquire()  # the first write into the directory: a read-only one fails here
        except OSError as err:
            raise RunDirError(io_message("write into run.dir", path, err)) from err
    prepare_run_dir(path, overwrite, resume)


@contextmanager
def failure_recorded(is_main: bool, record: Callable[[str], None]) -> Iterator[None]:
    """When the block raises, rank 0 calls ``record(error)`` (the trainer: write ``status.json``
    outcome ``failed`` with the error and the step), then the error goes on: a batch script (or
    ``hpctrain slurm status``) must never read ``running`` from a run that has ended. A record
    that cannot be written (the same full disk, say) is logged, never raised over the error
    that ended the run."""
    try:
        yield
    except BaseException as err:
        if is_main:
            try:
                record(describe(err))
            except OSError as record_err:
                log.warning("%s", io_message("record the failure in", record_err.filename or "status.json",
                                             record_err))
        raise


def missing_dirs(path: Path) -> list[Path]:
    """``path`` and those of its parents that do not exist yet, deepest first: what creating
    it will make, so that a run failing during set-up can remove them again."""
    missing: list[Path] = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing


def remove_empty_dirs(created: list[Path]) -> None:
    """Undo a failed start: remove the directories of :func:`missing_dirs` (and empty folders
    inside them) while they hold no file. A directory with any file in it is kept as it is."""
    if not created:
        return
    for folder in sorted((p for p in created[0].rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        _rmdir_if_empty(folder)
    for folder in created:
        if not _rmdir_if_empty(folder):
            return


def _rmdir_if_empty(folder: Path) -> bool:
    try:
        folder.rmdir()
    except OSError:  # not empty (or already gone): keep it
        return not folder.exists()
    return True
