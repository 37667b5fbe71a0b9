"""Opening a checkpoint's files as untrusted input (torch-free: ``hpctrain ckpt list`` uses it).

Whoever can write a checkpoint directory can rewrite its manifest, so a name or a file in it
proves nothing: a manifest may name ``../../etc/passwd`` or ``/dev/zero``, a file may be a
FIFO (an ``open`` that never returns), a symlink to ``/dev/urandom`` (a read that never
ends) or a 1 TiB sparse file (a read that exhausts memory). Every read of a checkpoint goes
through here: names are relative paths inside the directory, the path is resolved and must
stay inside it, it must be a regular file (checked before it is opened, so no device is ever
opened, and again on the open descriptor, opened non-blocking so a FIFO swapped in between
cannot block), and its size is known (``fstat``) before a byte is read.
"""

from __future__ import annotations

import errno
import io
import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from hpctrain.core import safe_open
from hpctrain.core.errors import RunError
from hpctrain.core.safe_open import NotRegularError, TooLargeError, UnsafeFileError

T = TypeVar("T")

# Files read whole into memory (manifest, torch.save skeleton, per-rank state, DCP metadata) are
# small: a skeleton holds names instead of tensors, a rank file RNG states and a loader position.
MAX_WHOLE = 1 << 30


class CheckpointError(RunError):
    """A checkpoint cannot be written or read; the message names the file and a hint."""


class RefusedFileError(CheckpointError):
    """A checkpoint names a path outside its directory, or holds something other than a regular
    file where a file belongs: crafted or damaged, never read."""


class MissingFileError(CheckpointError):
    """A file a checkpoint's manifest lists does not exist."""


_HINT = "hint: the checkpoint was not written by hpctrain (crafted or damaged): do not use it"


# Longest part and whole name a manifest may give: what file systems hold (NAME_MAX 255 bytes), with
# room under PATH_MAX for the run directory; hpctrain's own names are under 100 bytes.
MAX_PART_BYTES = 255
MAX_NAME_BYTES = 1024


def member(root: Path, name: object) -> Path:
    """``root / name`` for a name taken from a manifest: a relative path of plain parts
    (no ``..``, no ``.``, no empty part, not absolute, no part a file system cannot hold),
    else :class:`RefusedFileError`."""
    if not isinstance(name, str) or not name or "\0" in name or "\\" in name or name.startswith("/") \
            or any(part in ("", ".", "..") for part in name.split("/")):
        raise RefusedFileError(f"{Path(root) / 'manifest.json'} names {name!r}, which is not a file inside the "
                               f"checkpoint directory: refused; {_HINT}")
    if len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES \
            or any(len(part.encode("utf-8", "surrogatepass")) > MAX_PART_BYTES for part in name.split("/")):
        raise RefusedFileError(f"{Path(root) / 'manifest.json'} names a file {name[:40]!r}... of {len(name)} "
                               f"characters, longer than a file system holds ({MAX_PART_BYTES} bytes a part, "
                               f"{MAX_NAME_BYTES} in all): refused; {_HINT}")
    return Path(root) / name


def _inside(path: Path, root: Path) -> bool:
    real, base = os.path.realpath(path), os.path.realpath(root)
    return real == base or real.startswith(base.rstrip(os.sep) + os.sep)


def _refused(err: UnsafeFileError, what: str = "file") -> RefusedFileError:
    if isinstance(err, NotRegularError):
        return RefusedFileError(f"{err.path} is a {err.kind}, not a regular file: refused; {_HINT}")
    if isinstance(err, TooLargeError):
        return RefusedFileError(f"{err.path} holds {err.size:,} bytes, more than the {err.limit:,} a checkpoint's "
                                f"{what} ever holds: refused before reading; {_HINT}")
    return RefusedFileError(f"{err}: refused; {_HINT}")


def check_regular(path: Path, root: Path | None = None) -> int:
    """The size of ``path`` once it is known to be a regular file (inside ``root`` when given,
    symlinks resolved), without opening it. Raises :class:`RefusedFileError`,
    :class:`MissingFileError`, or the ``OSError`` of a file that cannot be read (permissions)."""
    if root is not None and not _inside(path, root):
        raise RefusedFileError(f"{path} leads outside the checkpoint directory {root} (a symlink, or a path "
                               f"through one): refused; {_HINT}")
    return _safely(lambda: safe_open.check_regular(path), path)


def _safely(call: Callable[[], T], path: Path, what: str = "file") -> T:
    """``call()`` with :mod:`hpctrain.core.safe_open`'s failures as this module's errors."""
    try:
        return call()
    except FileNotFoundError:
        raise MissingFileError(f"{path}: missing") from None
    except UnsafeFileError as err:
        raise _refused(err, what) from None
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise RefusedFileError(f"{path} is a symlink loop: refused; {_HINT}") from None
        raise


def open_regular(path: Path, root: Path | None = None) -> tuple[io.FileIO, int]:
    """``path`` opened for reading, and its size (``fstat`` of the open file), once
    :func:`check_regular` passed. Opened non-blocking and checked again on the descriptor:
    a FIFO or device swapped in after the check is refused, never waited on."""
    check_regular(path, root)
    return _safely(lambda: safe_open.open_regular(path), path)


def read_whole(path: Path, root: Path | None = None, limit: int = MAX_WHOLE, what: str = "file") -> bytes:
    """All bytes of a small file, refused (before a byte is read) when larger than ``limit``.
    At most its ``fstat`` size is read: a file that grows meanwhile cannot make it read on."""
    check_regular(path, root)
    return _safely(lambda: safe_open.read_regular(path, limit=limit), path, what)


read_at_most = safe_open.read_at_most  # callers' name for the bounded read
