"""A state tree as two files: a small skeleton (``torch.save``, tensors replaced by
names) and the tensor bytes in one safetensors-format file.

Why not ``torch.save`` for the bytes: its writer goes through the page cache, and on
this class of machine that caps a save near 0.3 of the disk (first-touch of cache pages,
then fsync). Here the bytes stream through a page-aligned bounce buffer with O_DIRECT,
while helper threads hash the same bytes (see :class:`TreeHash`); a load reads straight into
the live tensors (``readinto``), without a fresh allocation. The file is plain
safetensors (the header is padded with spaces so the data starts 4 KiB-aligned), so any
safetensors reader can open it.
"""

from __future__ import annotations

import errno
import hashlib
import itertools
import json
import mmap
import os
import struct
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from hpctrain.errors import RunError

ALIGN = 4096
CHUNK = 16 << 20
_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
_BY_NAME = {v: k for k, v in _DTYPES.items()}
_TAG = "__tensor__"
_local = threading.local()
LEAF = 64 << 20
DIGEST = "sha256_tree"  # the manifest key of a file's checksum (see TreeHash)
# Leaves hash in parallel; a GPU node's spare cores make checksums scale past the disk.
_hash_pool = ThreadPoolExecutor(max_workers=max(2, min(8, os.cpu_count() or 2)), thread_name_prefix="hpctrain-sha")


def _leaf(segments: list[memoryview]) -> bytes:
    digest = hashlib.sha256()
    for segment in segments:
        digest.update(segment)
    return digest.digest()


class TreeHash:
    """sha256 of the concatenated sha256 digests of the data's consecutive 64 MiB leaves.

    One sha256 runs at ~1.7 GB/s here, slower than the disk; leaves hash in parallel, so
    a checksum costs no save or load time. ``update`` keeps references to the data: it
    must stay alive and unchanged until :meth:`hexdigest` (callers pass ``bytes`` copies
    of transient buffers)."""

    def __init__(self) -> None:
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
        self._futures.append(_hash_pool.submit(_leaf, segments))

    def hexdigest(self) -> str:
        if self._segments or not self._futures:
            self._flush()
        return hashlib.sha256(b"".join(f.result() for f in self._futures)).hexdigest()

    def wait(self) -> None:
        for future in self._futures:
            future.result()


class TensorFileError(RunError):
    """The tensor file cannot be written or read; the message names the file."""


# ---------------------------------------------------------------- tree <-> (skeleton, tensors)


def split(tree: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """Replace every tensor by ``{"__tensor__": name}``; name = its path in the tree."""
    tensors: dict[str, torch.Tensor] = {}
    seen: dict[int, str] = {}

    def walk(obj: Any, path: str) -> Any:
        if isinstance(obj, torch.Tensor):
            if id(obj) not in seen:  # tied tensors are stored once
                name = path if path not in tensors else f"{path}#{len(tensors)}"
                seen[id(obj)], tensors[name] = name, obj
            return {_TAG: seen[id(obj)]}
        if isinstance(obj, dict):
            out = obj.copy()  # keeps the type and attributes (a state_dict's _metadata)
            for key, value in obj.items():
                out[key] = walk(value, f"{path}/{str(key).replace('/', '%2F')}")
            return out
        if isinstance(obj, (list, tuple)):
            items = [walk(v, f"{path}/{i}") for i, v in enumerate(obj)]
            return type(obj)(items) if not hasattr(obj, "_fields") else type(obj)(*items)
        return obj

    return walk(tree, ""), tensors


def join(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(skeleton, dict):
        if len(skeleton) == 1 and _TAG in skeleton:
            return tensors[skeleton[_TAG]]
        out = skeleton.copy()
        for key, value in skeleton.items():
            out[key] = join(value, tensors)
        return out
    if isinstance(skeleton, (list, tuple)):
        items = [join(v, tensors) for v in skeleton]
        return type(skeleton)(items) if not hasattr(skeleton, "_fields") else type(skeleton)(*items)
    return skeleton


# ---------------------------------------------------------------- writing


def _header(tensors: dict[str, torch.Tensor]) -> tuple[bytes, int]:
    entries: dict[str, Any] = {"__metadata__": {"format": "pt", "writer": "hpctrain"}}
    offset = 0
    for name, t in tensors.items():
        if t.dtype not in _DTYPES:
            raise TensorFileError(f"tensor {name!r} has dtype {t.dtype}, which the checkpoint format does not store")
        size = t.numel() * t.element_size()
        entries[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(entries, separators=(",", ":")).encode()
    pad = (-(8 + len(text))) % ALIGN  # data starts on a 4 KiB boundary (O_DIRECT)
    text += b" " * pad
    return struct.pack("<Q", len(text)) + text, offset


def _bytes(t: torch.Tensor) -> memoryview:
    flat = t.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    return memoryview(flat.view(torch.uint8).numpy()).cast("B") if flat.numel() else memoryview(b"")


def _bounce() -> mmap.mmap:
    buf = getattr(_local, "buf", None)
    if buf is None or len(buf) != CHUNK:  # page-aligned, touched once, reused by every save of this thread
        buf = mmap.mmap(-1, CHUNK)
        buf.write(b"\0" * CHUNK)
        _local.buf = buf
    return buf


def write(path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Write ``tensors`` (CPU) to ``path`` durably; returns its manifest entry."""
    header, data_size = _header(tensors)
    pieces = [memoryview(header), *(_bytes(t) for t in tensors.values())]
    try:
        return _write(path, pieces, direct=True)
    except OSError as err:
        if err.errno != errno.EINVAL:  # O_DIRECT unsupported here (tmpfs, some FUSE): go buffered
            raise
    return _write(path, pieces, direct=False)


def _write(path: Path, pieces: list[memoryview], direct: bool) -> dict[str, Any]:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags, 0o644)
    digest = TreeHash()
    try:
        buf, fill, total = _bounce(), 0, 0
        view = memoryview(buf)
        for piece in pieces:
            digest.update(piece)  # leaves hash in helper threads, beside the writes
            start = 0
            while start < len(piece):
                n = min(CHUNK - fill, len(piece) - start)
                view[fill : fill + n] = piece[start : start + n]
                fill, start, total = fill + n, start + n, total + n
                if fill == CHUNK:
                    _write_all(fd, view[:fill])
                    fill = 0
        if fill:
            padded = fill + (-fill) % ALIGN if direct else fill
            view[fill:padded] = b"\0" * (padded - fill)
            _write_all(fd, view[:padded])
        os.ftruncate(fd, total)  # drop the O_DIRECT tail padding
        os.fsync(fd)
    finally:
        digest.wait()  # never leave a hash reading memory the caller may reuse
        os.close(fd)
    return {"size": total, DIGEST: digest.hexdigest()}


def _write_all(fd: int, data: memoryview) -> None:
    while len(data):
        written = os.write(fd, data)
        data = data[written:]


# ---------------------------------------------------------------- reading


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) != 8:
            raise TensorFileError(f"{path} is truncated (no header)")
        (length,) = struct.unpack("<Q", raw)
        try:
            header = json.loads(fh.read(length))
        except ValueError as err:
            raise TensorFileError(f"{path}: header is not valid JSON ({err})") from None
    header.pop("__metadata__", None)
    return header, 8 + length


def read(path: Path, into: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """All tensors of ``path``. Where ``into`` holds a tensor of the same name, shape and
    dtype, the bytes are read straight into it (no new allocation)."""
    header, data_start = read_header(path)
    into = into or {}
    out: dict[str, torch.Tensor] = {}
    with open(path, "rb", buffering=0) as fh:
        for name, entry in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
            dtype, shape = _BY_NAME[entry["dtype"]], tuple(entry["shape"])
            begin, end = entry["data_offsets"]
            target = into.get(name)
            if target is None or tuple(target.shape) != shape or target.dtype != dtype or not target.is_contiguous() \
                    or target.device.type != "cpu":
                target = torch.empty(shape, dtype=dtype)
            fh.seek(data_start + begin)
            _read_exact(fh, _bytes(target), path)
            if end - begin != target.numel() * target.element_size():
                raise TensorFileError(f"{path}: tensor {name!r} has {end - begin} bytes for shape {list(shape)}")
            out[name] = target
    return out


def _read_exact(fh: Any, dest: memoryview, path: Path) -> None:
    done = 0
    while done < len(dest):
        n = fh.readinto(dest[done : done + CHUNK])
        if not n:
            raise TensorFileError(f"{path} is truncated")
        done += n


def hash_file(path: Path) -> dict[str, Any]:
    """The manifest entry of a file on disk: leaves are read one after another and
    hashed in parallel (buffers reused, three in flight)."""
    bufs = getattr(_local, "leaves", None)
    if bufs is None:
        bufs = _local.leaves = [bytearray(LEAF) for _ in range(3)]
    futures: list[Future[bytes]] = []
    size = 0
    with open(path, "rb", buffering=0) as fh:
        for i in itertools.count():
            if i >= 3:
                futures[i - 3].result()  # its buffer is about to be reused
            buf = memoryview(bufs[i % 3])
            n = _read_full(fh, buf)
            if n == 0 and i > 0:
                break
            futures.append(_hash_pool.submit(_leaf, [buf[:n]]))
            size += n
            if n < LEAF:
                break
    digest = hashlib.sha256(b"".join(f.result() for f in futures)).hexdigest()
    return {"size": size, DIGEST: digest}


def _read_full(fh: Any, buf: memoryview) -> int:
    done = 0
    while done < len(buf):
        n = fh.readinto(buf[done:])
        if not n:
            break
        done += n
    return done
