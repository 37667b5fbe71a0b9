"""Writes that land whole or not at all: a temporary name beside the target, flush, fsync,
rename, fsync of the parent directory. Every file hpctrain writes into a run directory, a
checkpoint or a data set goes through here (core: no torch, no other hpctrain module)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any


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
