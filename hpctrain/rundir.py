"""The run directory: config.yaml, metrics.jsonl, model.pt, summary.json.

Files are written whole or not at all (temporary name, fsync, rename), and a finished
run is never overwritten unless ``run.overwrite=true``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import IO, Any

import torch
from torch import nn

from hpctrain.errors import UserError

SUMMARY = "summary.json"
CHECKPOINTS = "checkpoints"


class RunDirError(UserError):
    """The run directory cannot be used; the message says why and what to do."""


def resolve_run_dir(template: str, cfg: Any) -> Path:
    """``run.dir`` may name config values: ``runs/{data.name}-{model.name}``."""
    sections = {name: getattr(cfg, name) for name in vars(cfg)}
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
    if checkpoints.is_dir() and any(checkpoints.iterdir()) and (finished or resume == "never"):
        if not overwrite:
            raise RunDirError(
                f"run.dir {path} holds checkpoints of an unfinished run; hint: resume=auto continues it, "
                "run.overwrite=true starts over"
            )
        return True
    return False


def _remove_old_checkpoints(checkpoints: Path) -> None:
    # Rename first, so a crash half-way never leaves a mix that resume=auto would read.
    trash = checkpoints.with_name(f".{CHECKPOINTS}.old-{os.getpid()}")
    try:
        os.replace(checkpoints, trash)
        shutil.rmtree(trash)
    except OSError as err:
        raise RunDirError(f"run.overwrite=true: cannot remove the old {checkpoints}: {err}") from err


def atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def write_json(path: Path, data: dict[str, Any]) -> None:
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def save_model(model: nn.Module, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    torch.save(model.state_dict(), tmp)
    with open(tmp, "rb+") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def params_sha256(model: nn.Module) -> str:
    """sha256 of every parameter's bytes, in sorted name order: equal hashes = equal weights."""
    digest = hashlib.sha256()
    for _, param in sorted(model.named_parameters(), key=lambda item: item[0]):
        digest.update(param.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class MetricsLog:
    """Append-only metrics.jsonl (rank 0 only); lines are flushed so a crash keeps them."""

    def __init__(self, path: Path | None) -> None:
        self._fh: IO[str] | None = open(path, "a") if path is not None else None

    def write(self, row: dict[str, Any]) -> None:
        if self._fh is not None:
            self._fh.write(json.dumps(row) + "\n")
            self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
