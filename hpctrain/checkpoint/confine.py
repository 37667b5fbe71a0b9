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
import stat
from pathlib import Path

from hpctrain.core.errors import RunError

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


def member(root: Path, name: object) -> Path:
    """``root / name`` for a name taken from a manifest: a relative path of plain parts
    (no ``..``, no ``.``, no empty part, not absolute), else :class:`RefusedFileError`."""
    if not isinstance(name, str) or not name or "\0" in name or "\\" in name or name.startswith("/") \
            or any(part in ("", ".", "..") for part in name.split("/")):
        raise RefusedFileError(f"{Path(root) / 'manifest.json'} names {name!r}, which is not a file inside the "
                               f"checkpoint directory: refused; {_HINT}")
    return Path(root) / name


def _kind(mode: int) -> str:
    for test, what in ((stat.S_ISFIFO, "FIFO"), (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
                       (stat.S_ISSOCK, "socket"), (stat.S_ISDIR, "directory")):
        if test(mode):
            return what
    return "special file"


def _inside(path: Path, root: Path) -> bool:
    real, base = os.path.realpath(path), os.path.realpath(root)
    return real == base or real.startswith(base.rstrip(os.sep) + os.sep)


def check_regular(path: Path, root: Path | None = None) -> int:
    """The size of ``path`` once it is known to be a regular file (inside ``root`` when given,
    symlinks resolved), without opening it. Raises :class:`RefusedFileError`,
    :class:`MissingFileError`, or the ``OSError`` of a file that cannot be read (permissions)."""
    if root is not None and not _inside(path, root):
        raise RefusedFileError(f"{path} leads outside the checkpoint directory {root} (a symlink, or a path "
                               f"through one): refused; {_HINT}")
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise MissingFileError(f"{path}: missing") from None
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise RefusedFileError(f"{path} is a symlink loop: refused; {_HINT}") from None
        raise
    if not stat.S_ISREG(st.st_mode):
        raise RefusedFileError(f"{path} is a {_kind(st.st_mode)}, not a regular file: refused; {_HINT}")
    return st.st_size


def open_regular(path: Path, root: Path | None = None) -> tuple[io.FileIO, int]:
    """``path`` opened for reading, and its size (``fstat`` of the open file), once
    :func:`check_regular` passed. Opened non-blocking and checked again on the descriptor:
    a FIFO or device swapped in after the check is refused, never waited on."""
    check_regular(path, root)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RefusedFileError(f"{path} is a {_kind(st.st_mode)}, not a regular file: refused; {_HINT}")
        os.set_blocking(fd, True)  # a regular file: reads behave as usual
    except BaseException:
        os.close(fd)
        raise
    return io.FileIO(fd, "r", closefd=True), st.st_size


def read_whole(path: Path, root: Path | None = None, limit: int = MAX_WHOLE, what: str = "file") -> bytes:
    """All bytes of a small file, refused (before a byte is read) when larger than ``limit``.
    At most its ``fstat`` size is read: a file that grows meanwhile cannot make it read on."""
    fh, size = open_regular(path, root)
    with fh:
        if size > limit:
            raise RefusedFileError(f"{path} holds {size:,} bytes, more than the {limit:,} a checkpoint's {what} "
                                   f"ever holds: refused before reading; {_HINT}")
        return read_at_most(fh, size)


def read_at_most(fh: io.FileIO, size: int) -> bytes:
    """Up to ``size`` bytes of ``fh`` (fewer where it ends sooner)."""
    chunks, left = [], size
    while left > 0:
        chunk = fh.read(min(left, 16 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
