"""The one way hpctrain opens a file it did not write itself (core layer, torch-free).

A path taken from a manifest, a foreign run directory or a data set can name anything: a FIFO
(an ``open`` or ``read`` that never returns), a device (``/dev/urandom``: a read that never
ends; some devices act when opened), a directory, or a sparse 1 TiB file (a read that exhausts
memory). Every such open goes through here:

1. ``os.stat`` first (symlinks followed): anything but a regular file is refused before it is
   opened, so no device is ever opened;
2. opened non-blocking and checked again with ``fstat`` on the descriptor: a FIFO swapped in
   between the two steps is refused, never waited on;
3. the size (``fstat``) is checked against a declared ``size`` or a ``limit`` before a byte is read,
   and whole-file reads read at most that size, so a file that grows meanwhile cannot make them
   read on.

A limit that a genuine file could exceed is a :class:`Limit`: a default, and an environment
variable that raises it (``HPCTRAIN_MAX_..._BYTES``), both named in the refusal, so the message says
which limit refused the file and how to raise it.

Failures are plain exceptions that callers wrap in their own error class and hint:
``OSError`` (missing, unreadable, a symlink loop: ``FileNotFoundError`` for a missing file) and
:class:`UnsafeFileError` (a ``ValueError``: :class:`NotRegularError`, :class:`TooLargeError`,
:class:`WrongSizeError`), each with a neutral message that names the path.
"""

from __future__ import annotations

import io
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from hpctrain.core.errors import UserError

_CHUNK = 16 << 20  # bytes per read of a whole-file read: no single allocation of a huge size


class UnsafeFileError(ValueError):
    """A file that must not be read as asked; ``path`` names it."""

    def __init__(self, message: str, path: str | os.PathLike[str]) -> None:
        super().__init__(message)
        self.path = Path(path)


class NotRegularError(UnsafeFileError):
    """Something other than a regular file; ``kind`` says what ("FIFO", "directory", ...)."""

    def __init__(self, path: str | os.PathLike[str], kind: str) -> None:
        super().__init__(f"{path} is a {kind}, not a regular file", path)
        self.kind = kind


class TooLargeError(UnsafeFileError):
    """A regular file of ``size`` bytes, more than ``limit``."""

    def __init__(self, path: str | os.PathLike[str], size: int, limit: int) -> None:
        super().__init__(f"{path} holds {size:,} bytes, more than the {limit:,} it can hold", path)
        self.size, self.limit = size, limit


class WrongSizeError(UnsafeFileError):
    """A regular file of ``size`` bytes where ``expected`` were declared."""

    def __init__(self, path: str | os.PathLike[str], size: int, expected: int) -> None:
        super().__init__(f"{path} holds {size:,} bytes, {expected:,} were declared", path)
        self.size, self.expected = size, expected


@dataclass(frozen=True)
class Limit:
    """The most bytes hpctrain reads of one kind of file (``what``): ``default``, or the environment
    variable ``env`` where it is set (a whole number of bytes)."""

    what: str  # "a shard manifest or index"
    env: str  # "HPCTRAIN_MAX_JSON_BYTES"
    default: int

    def bytes(self) -> int:
        raw = os.environ.get(self.env, "").strip()
        if not raw:
            return self.default
        if not (raw.isascii() and raw.isdigit()) or int(raw) <= 0:
            raise UserError(f"{self.env}={raw!r} must be a whole number of bytes > 0 (the most {self.what} may hold; "
                            f"default {self.default:,}); hint: unset it, or {self.env}={self.default}")
        return int(raw)

    def refusal(self, where: str, size: int) -> str:
        """Why ``where`` (of ``size`` bytes) is refused, and how to raise the limit."""
        return (f"{where} holds {size:,} bytes, more than the {self.bytes():,} that {self.what} may hold "
                f"({self.env}); hint: if the file is genuine, raise the limit: {self.env}={size}")


def file_kind(mode: int) -> str:
    """What a non-regular ``st_mode`` is, in words."""
    for test, what in ((stat.S_ISFIFO, "FIFO"), (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
                       (stat.S_ISSOCK, "socket"), (stat.S_ISDIR, "directory")):
        if test(mode):
            return what
    return "special file"


def _check_size(path: str | os.PathLike[str], got: int, size: int | None, limit: int | None) -> None:
    if size is not None and got != size:
        raise WrongSizeError(path, got, size)
    if limit is not None and got > limit:
        raise TooLargeError(path, got, limit)


def check_regular(path: str | os.PathLike[str], *, size: int | None = None, limit: int | None = None) -> int:
    """The size of ``path`` once ``os.stat`` shows a regular file of the declared ``size`` (or at
    most ``limit`` bytes), without opening it."""
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise NotRegularError(path, file_kind(st.st_mode))
    _check_size(path, st.st_size, size, limit)
    return st.st_size


def open_regular(path: str | os.PathLike[str], *, size: int | None = None,
                 limit: int | None = None) -> tuple[io.FileIO, int]:
    """``path`` opened for reading (binary, unbuffered) and its ``fstat`` size, once it is known to
    be a regular file of the declared ``size`` (or at most ``limit`` bytes), checked before the
    open and again on the descriptor. The caller closes the file (``with fh:``)."""
    check_regular(path)  # no device is ever opened; sizes are checked on the descriptor below
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularError(path, file_kind(st.st_mode))
        _check_size(path, st.st_size, size, limit)
        os.set_blocking(fd, True)  # a regular file: reads behave as usual
    except BaseException:
        os.close(fd)
        raise
    return io.FileIO(fd, "r", closefd=True), st.st_size


def read_at_most(fh: io.RawIOBase | io.BufferedIOBase, size: int) -> bytes:
    """Up to ``size`` bytes of ``fh`` (fewer where it ends sooner), in bounded reads."""
    chunks, left = [], size
    while left > 0:
        chunk = fh.read(min(left, _CHUNK))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_regular(path: str | os.PathLike[str], *, limit: int, size: int | None = None) -> bytes:
    """All bytes of a regular file of at most ``limit`` bytes (and of the declared ``size``),
    refused before a byte is read otherwise; at most its ``fstat`` size is read."""
    fh, got = open_regular(path, size=size, limit=limit)
    with fh:
        return read_at_most(fh, got)


def read_head(path: str | os.PathLike[str], limit: int) -> bytes:
    """The first ``limit`` bytes of a regular file of any size (a marker's or a log's head)."""
    fh, got = open_regular(path)
    with fh:
        return read_at_most(fh, min(got, limit))
