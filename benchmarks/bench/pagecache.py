"""Page-cache eviction shared by the benchmarks (``benchmarks/`` and ``hpctrain bench``)."""

from __future__ import annotations

import os
from pathlib import Path


def evict(path: Path) -> None:
    """Drop a file's or a directory's files from the page cache, so a read comes from the disk."""
    for file in [path] if path.is_file() else path.rglob("*"):
        if file.is_file():
            fd = os.open(file, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
