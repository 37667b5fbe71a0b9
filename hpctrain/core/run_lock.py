"""One run at a time in a run directory.

Two runs on one directory (a restart while the first still runs, two users with the same
config) delete each other's in-flight saves and interleave their metrics. The first run's
rank 0 holds an ``fcntl`` lock on ``RUN_DIR/.hpctrain.lock`` for its whole life and writes
its host, pid and start time into it; a second run finds the lock taken and refuses with
exit 2 naming that owner. The kernel drops the lock when its holder dies however it dies
(SIGKILL included), so a dead owner never keeps it: the next run takes it over and logs
whose it was. ``fcntl`` locks work across nodes on NFSv4 and on Lustre mounted with
``-o flock``; where the file system refuses locks, the run goes on unlocked with a warning.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

from hpctrain.core.errors import UserError

log = logging.getLogger(__name__)

LOCK_NAME = ".hpctrain.lock"
_BUSY = (errno.EAGAIN, errno.EACCES)
_UNSUPPORTED = (errno.ENOLCK, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP)


class RunDirInUseError(UserError):
    """Another live run holds the run directory."""


class RunDirLinkError(UserError):
    """The lock's name in the run directory is a symbolic link."""


class RunDirLock:
    """The lock of one run directory, held by one process (the run's rank 0)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock, or raise :class:`RunDirInUseError` naming its live owner."""
        while self._fd is None:
            fd = self._open()
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                os.close(fd)
                if err.errno in _UNSUPPORTED:
                    log.warning("run.dir %s: this file system refuses locks (%s); a second run on it would not be "
                                "stopped", self.path.parent, os.strerror(err.errno))
                    return
                if err.errno in _BUSY:
                    raise RunDirInUseError(self._in_use_message()) from None
                raise
            if self._same_file(fd):  # not a file an ending owner unlinked meanwhile
                self._fd = fd
            else:
                os.close(fd)
        self._take_over()

    def _open(self) -> int:
        """The lock file, never through a symbolic link: taking the lock truncates and rewrites it, which
        through a link would overwrite the file it points to (hpctrain.core.rundir.check_links says so
        first; this holds even for a link made since)."""
        try:
            return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as err:
            if err.errno != errno.ELOOP:
                raise
            raise RunDirLinkError(f"run.dir {self.path.parent}: {LOCK_NAME} is a symbolic link to "
                                  f"{os.path.realpath(self.path)}; hpctrain never writes through a link; hint: remove "
                                  f"it ({self.path})") from None

    def release(self) -> None:
        """Unlink (while still holding it) and drop the lock; a no-op when not held."""
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)
        finally:
            os.close(self._fd)
            self._fd = None

    def _same_file(self, fd: int) -> bool:
        try:
            return os.fstat(fd).st_ino == os.stat(self.path).st_ino
        except FileNotFoundError:
            return False

    def _take_over(self) -> None:
        assert self._fd is not None
        previous = _owner(os.pread(self._fd, 4096, 0))
        if previous:
            log.warning("run.dir %s: taking over the lock of a run that ended without releasing it (%s)",
                        self.path.parent, _describe(previous))
        mine = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}).encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, mine, 0)
        os.fsync(self._fd)

    def _in_use_message(self) -> str:
        try:
            owner = _owner(self.path.read_bytes())
        except OSError:
            owner = {}
        return (f"run.dir {self.path.parent} is in use by another run ({_describe(owner)}); hint: wait for it to "
                f"end or stop it; to run both, give this one another run.dir")


def _owner(data: bytes) -> dict[str, Any]:
    try:
        owner = json.loads(data.decode() or "{}")
    except (UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return owner if isinstance(owner, dict) else {}


def _describe(owner: dict[str, Any]) -> str:
    if not owner:
        return "owner unknown"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(owner.get("since", 0))))
    return f"host {owner.get('host', '?')}, pid {owner.get('pid', '?')}, since {since}"
