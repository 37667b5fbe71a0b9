"""Checksums of checkpoint files (torch-free: `hpctrain ckpt verify` on a login node uses them).

Every algorithm hashes a file the same way, as a tree: the digests of the file's consecutive
64 MiB pieces (leaves), hashed again. Leaves hash in parallel helper threads beside the write
or read, so a checksum costs no save or load time while a core is free. Which hash: the
manifest entry's key names it (``xxh3_128_tree``, ``crc32_tree``, ``sha256_tree``), so a
checkpoint written with any of them (sha256 before ``checkpoint.hash`` existed) verifies.

Why xxh3 by default: on the 2-core development VM one stream hashes at ~10.6 GB/s with
xxh3_128 (the ``xxhash`` package), 3.6 with zlib's crc32 and 1.5 with sha256, against a
disk that reads at ~0.5-0.7 GB/s; sha256's CPU is the load's CPU on a busy node. All three
catch any flipped byte; sha256 is there for provenance (a digest others can recompute with
standard tools), not for integrity, which the faster hashes give as well.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import threading
import zlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from hpctrain.checkpoint import confine
from hpctrain.core.errors import UserError

log = logging.getLogger("hpctrain")

LEAF = 64 << 20
# Leaves hash in parallel; a GPU node's spare cores make checksums scale past the disk.
_hash_pool = ThreadPoolExecutor(max_workers=max(2, min(8, os.cpu_count() or 2)), thread_name_prefix="hpctrain-hash")
_local = threading.local()


class Hasher(Protocol):
    def update(self, data: Any, /) -> None: ...

    def digest(self) -> bytes: ...


class ChecksumUnavailableError(UserError):
    """A checksum's hash is not installed here (xxh3 needs the ``xxhash`` package): exit 2,
    never "corrupt"."""


class _Crc32:
    """zlib's crc32 behind hashlib's interface (zlib releases the GIL on large buffers)."""

    def __init__(self) -> None:
        self._value = 0

    def update(self, data: Any) -> None:
        self._value = zlib.crc32(data, self._value)

    def digest(self) -> bytes:
        return self._value.to_bytes(4, "big")


def _xxh3() -> Hasher:
    try:
        import xxhash  # the C library releases the GIL while it hashes
    except ImportError:
        raise ChecksumUnavailableError(
            "the xxh3 checksum needs the xxhash package, which is not installed here; hint: `pip install xxhash`, "
            "or write checkpoints with checkpoint.hash=crc32 or sha256") from None
    return xxhash.xxh3_128()


@dataclass(frozen=True)
class Algorithm:
    name: str  # the value of checkpoint.hash
    key: str   # the manifest entry's key of the digest
    new: Callable[[], Hasher]
    doc: str   # what the manifest's "checksum" field says

    def available(self) -> bool:
        try:
            self.new()
        except ChecksumUnavailableError:
            return False
        return True


def _sha256() -> Hasher:
    return hashlib.sha256()


ALGORITHMS = {a.name: a for a in (
    Algorithm("xxh3", "xxh3_128_tree", _xxh3, "xxh3_128_tree: xxh3_128 of the concatenated xxh3_128 digests "
              "(16 bytes each, big-endian) of the file's consecutive 64 MiB pieces"),
    Algorithm("crc32", "crc32_tree", _Crc32, "crc32_tree: zlib crc32 of the concatenated crc32 values "
              "(4 bytes each, big-endian) of the file's consecutive 64 MiB pieces"),
    Algorithm("sha256", "sha256_tree", _sha256, "sha256_tree: sha256 of the concatenated sha256 digests "
              "of the file's consecutive 64 MiB pieces"),
)}
DEFAULT = "xxh3"
SHA256_KEY = ALGORITHMS["sha256"].key  # the only key of checkpoints written before checkpoint.hash existed
_warned: set[str] = set()


def resolve(name: str) -> Algorithm:
    """The algorithm that writes for ``checkpoint.hash=name``: xxh3 without the xxhash package
    falls back to crc32, said once in the log (a run does not fail for lack of a speed-up)."""
    algorithm = ALGORITHMS[name]
    if name == "xxh3" and not algorithm.available():
        if name not in _warned:
            _warned.add(name)
            log.warning("checkpoint.hash=xxh3: the xxhash package is not installed, checkpoints are checksummed "
                        "with crc32 instead; hint: `pip install xxhash` (or set checkpoint.hash=crc32 to silence this)")
        return ALGORITHMS["crc32"]
    return algorithm


def of_entry(entry: dict[str, Any]) -> Algorithm | None:
    """The algorithm whose digest a manifest entry holds (None: no key this version knows)."""
    for algorithm in ALGORITHMS.values():
        if algorithm.key in entry:
            return algorithm
    return None


def mismatch(entry: dict[str, Any], got: dict[str, Any], where: Path) -> str | None:
    """Why ``got`` (a file's size, and its digest when the sizes agree) does not match its
    manifest ``entry``; None if it does."""
    if got["size"] != entry.get("size"):
        return f"{where}: size {got['size']} != {entry.get('size')} in the manifest (truncated or overwritten)"
    algorithm = of_entry(entry)
    if algorithm is None:
        return (f"{where}: its manifest entry holds no checksum this version knows (one of "
                f"{', '.join(a.key for a in ALGORITHMS.values())}) (corrupted, or written by a newer hpctrain)")
    if got.get(algorithm.key) != entry[algorithm.key]:
        return f"{where}: checksum ({algorithm.key}) does not match the manifest (corrupted)"
    return None


def _leaf(new: Callable[[], Hasher], segments: list[memoryview]) -> bytes:
    digest = new()
    for segment in segments:
        digest.update(segment)
    return digest.digest()


class TreeHash:
    """The tree checksum of the data passed to :meth:`update`, leaves hashed by helper threads
    while the caller goes on. ``update`` keeps references to the data: it must stay alive and
    unchanged until :meth:`hexdigest` (callers pass ``bytes`` copies of transient buffers)."""

    def __init__(self, algorithm: Algorithm) -> None:
        self.algorithm = algorithm
        algorithm.new()  # unavailable (no xxhash): raised here, before any byte is read
        self._futures: list[Future[bytes]] = []
        self._segments: list[memoryview] = []
        self._fill = 0

    def update(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            n = min(LEAF - self._fill, len(view))
            self._segments.append(view[:n])
            self._fill, view = self._fill + n, view[n:]
            if self._fill == LEAF:
                self._flush()

    def _flush(self) -> None:
        segments, self._segments, self._fill = self._segments, [], 0
        self._futures.append(_hash_pool.submit(_leaf, self.algorithm.new, segments))

    def hexdigest(self) -> str:
        if self._segments or not self._futures:
            self._flush()
        return _root(self.algorithm, [f.result() for f in self._futures])

    def entry(self, size: int) -> dict[str, Any]:
        """The manifest entry of ``size`` bytes hashed here."""
        return {"size": size, self.algorithm.key: self.hexdigest()}

    def wait(self) -> None:
        for future in self._futures:
            future.result()


def _root(algorithm: Algorithm, leaves: list[bytes]) -> str:
    root = algorithm.new()
    root.update(b"".join(leaves))
    return root.digest().hex()


def hash_bytes(data: bytes, algorithm: Algorithm) -> dict[str, Any]:
    """The manifest entry of ``data`` (a small file read into memory)."""
    digest = TreeHash(algorithm)
    digest.update(data)
    return digest.entry(len(data))


def hash_file(path: Path, algorithm: Algorithm | None = None, root: Path | None = None) -> dict[str, Any]:
    """The manifest entry of a file on disk (default: ``checkpoint.hash``'s default): leaves
    are read one after another and hashed in parallel (buffers reused, three in flight). Only
    a regular file (inside ``root`` when given) is read, and no further than its size when
    opened: a FIFO, a device or a file that keeps growing cannot make the hash run forever."""
    algorithm = algorithm or resolve(DEFAULT)
    algorithm.new()  # unavailable: raised before the file is read
    bufs = getattr(_local, "leaves", None)
    if bufs is None or len(bufs[0]) != LEAF:
        bufs = _local.leaves = [bytearray(LEAF) for _ in range(3)]
    futures: list[Future[bytes]] = []
    size = 0
    fh, limit = confine.open_regular(path, root)
    with fh:
        for i in itertools.count():
            if i >= 3:
                futures[i - 3].result()  # its buffer is about to be reused
            buf = memoryview(bufs[i % 3])[: min(LEAF, limit - size)]
            n = _read_full(fh, buf)
            if n == 0 and i > 0:
                break
            futures.append(_hash_pool.submit(_leaf, algorithm.new, [buf[:n]]))
            size += n
            if n < LEAF or size >= limit:
                break
    return {"size": size, algorithm.key: _root(algorithm, [f.result() for f in futures])}


def _read_full(fh: Any, buf: memoryview) -> int:
    done = 0
    while done < len(buf):
        n = fh.readinto(buf[done:])
        if not n:
            break
        done += n
    return done
