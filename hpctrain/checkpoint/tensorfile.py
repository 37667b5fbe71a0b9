"""A state tree as two files: a small skeleton (``torch.save``, tensors replaced by
names) and the tensor bytes in one safetensors-format file.

Why not ``torch.save`` for the bytes: its writer goes through the page cache, and on
this class of machine that caps a save near 0.3 of the disk (first-touch of cache pages,
then fsync). Here the bytes stream through a page-aligned bounce buffer with O_DIRECT,
while helper threads hash the same bytes (see :class:`checksum.TreeHash`); a load reads straight into
the live tensors (``readinto``), without a fresh allocation. The file is plain
safetensors (the header is padded with spaces so the data starts 4 KiB-aligned), so any
safetensors reader can open it.
"""

from __future__ import annotations

import errno
import io
import json
import math
import mmap
import os
import struct
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from hpctrain.checkpoint import checksum, confine
from hpctrain.checkpoint.checksum import Algorithm, TreeHash
from hpctrain.core.errors import RunError

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
            name = skeleton[_TAG]
            if not isinstance(name, str) or name not in tensors:  # a skeleton and tensors of different saves
                raise TensorFileError(f"the skeleton names tensor {_shown(name)}, which the tensor file does not hold "
                                      "(crafted or corrupted)")
            return tensors[name]
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
    for name, t in tensors.items():
        check_dtype(name, t.dtype)
    return header((name, t.dtype, tuple(t.shape)) for name, t in tensors.items())


def check_dtype(name: str, dtype: torch.dtype) -> None:
    if dtype not in _DTYPES:
        raise TensorFileError(f"tensor {name!r} has dtype {dtype}, which the checkpoint format does not store")


def header(specs: Iterable[tuple[str, torch.dtype, tuple[int, ...]]]) -> tuple[bytes, int]:
    """The file's header for tensors (name, dtype, shape) laid out in this order, and the
    size of their data: known before any tensor exists, so a writer can stream them."""
    entries: dict[str, Any] = {"__metadata__": {"format": "pt", "writer": "hpctrain"}}
    offset = 0
    for name, dtype, shape in specs:
        check_dtype(name, dtype)
        size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        entries[name] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(entries, separators=(",", ":")).encode()
    pad = (-(8 + len(text))) % ALIGN  # data starts on a 4 KiB boundary (O_DIRECT)
    text += b" " * pad
    return struct.pack("<Q", len(text)) + text, offset


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A CPU tensor's bytes in row-major order (a contiguous copy only when it is not)."""
    return _bytes(t)


def _bytes(t: torch.Tensor) -> memoryview:
    flat = t.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    if not flat.numel():
        return memoryview(b"")
    array: Any = flat.view(torch.uint8).numpy()  # numpy arrays are buffers; the stubs disagree
    return memoryview(array).cast("B")


def _bounce() -> mmap.mmap:
    buf = getattr(_local, "buf", None)
    if buf is None or len(buf) != CHUNK:  # page-aligned, touched once, reused by every save of this thread
        buf = mmap.mmap(-1, CHUNK)
        buf.write(b"\0" * CHUNK)
        _local.buf = buf
    return buf


def write(path: Path, tensors: dict[str, torch.Tensor], algorithm: Algorithm | None = None) -> dict[str, Any]:
    """Write ``tensors`` (CPU) to ``path`` durably; returns its manifest entry, checksummed
    with ``algorithm`` (default: checkpoint.hash's default)."""
    header, data_size = _header(tensors)
    pieces = [memoryview(header), *(_bytes(t) for t in tensors.values())]
    algorithm = algorithm or checksum.resolve(checksum.DEFAULT)
    try:
        return _write(path, pieces, direct=True, algorithm=algorithm)
    except OSError as err:
        if err.errno != errno.EINVAL:  # O_DIRECT unsupported here (tmpfs, some FUSE): go buffered
            raise
    return _write(path, pieces, direct=False, algorithm=algorithm)


def _write(path: Path, pieces: list[memoryview], direct: bool, algorithm: Algorithm) -> dict[str, Any]:
    digest = TreeHash(algorithm)  # before the file is created: an unavailable hash leaves nothing behind
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags, 0o644)
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
    return digest.entry(total)


def _write_all(fd: int, data: memoryview) -> None:
    while len(data):
        written = os.write(fd, data)
        data = data[written:]


# ---------------------------------------------------------------- reading


MAX_HEADER = 100 << 20  # bytes of header JSON (safetensors' own readers refuse more); ~100 bytes a tensor


def read_header(path: Path, root: Path | None = None) -> tuple[dict[str, Any], int]:
    """The validated header of ``path`` (a regular file, inside ``root`` when given) and
    where its data starts; raises :class:`TensorFileError` for any header that
    :func:`read` would refuse. Reads the header only."""
    fh, size = confine.open_regular(path, root)
    with fh:
        raw, header = _read_header(fh, path, size)
    return _checked(header, path, size - len(raw)), len(raw)


def _read_header(fh: Any, path: Path, size: int) -> tuple[bytes, dict[str, Any]]:
    """The raw header bytes (length prefix included: they are part of the checksum) and
    the parsed header without its metadata. The length is compared with the file's
    ``size`` and :data:`MAX_HEADER` before the header is read."""
    prefix = fh.read(8)
    if len(prefix) != 8:
        raise TensorFileError(f"{path} is truncated (no header)")
    (length,) = struct.unpack("<Q", prefix)
    if length > min(MAX_HEADER, size - 8):
        raise TensorFileError(f"{path}: header length {length:,} is more than the file's {size - 8:,} bytes after "
                              f"it or the {MAX_HEADER:,} allowed (truncated, corrupted or crafted)")
    text = fh.read(length)
    if len(text) != length:
        raise TensorFileError(f"{path} is truncated (header of {length} bytes)")
    try:
        header = json.loads(text)
    except RecursionError:  # json's C scanner stops at the interpreter's recursion limit: no stack overflow
        raise TensorFileError(f"{path}: header nests deeper than a tensor file's three levels (crafted)") from None
    except ValueError as err:
        raise TensorFileError(f"{path}: header is not valid JSON ({err})") from None
    if not isinstance(header, dict):
        raise TensorFileError(f"{path}: header is not a JSON object")
    header.pop("__metadata__", None)
    return prefix + text, header


class ChecksumError(TensorFileError):
    """The bytes read do not match the manifest's size or checksum."""


class TooLargeError(TensorFileError):
    """The file's tensors need more new memory than is available here: not read."""


def read(path: Path, into: dict[str, torch.Tensor] | None = None,
         expect: dict[str, Any] | None = None, root: Path | None = None) -> dict[str, torch.Tensor]:
    """All tensors of ``path``. Where ``into`` holds a tensor of the same name, shape and
    dtype, the bytes are read straight into it (no new allocation).

    ``expect`` (the file's manifest entry): size and checksum (whichever algorithm the
    entry names) are checked in the same pass. Each byte is read once, into its tensor, and
    hashed there by helper threads while the next bytes are read; a mismatch raises
    :class:`ChecksumError` once the read is done, before the caller can use the tensors
    (the caller must then treat ``into`` as overwritten).

    Nothing is allocated before the header is validated (:func:`_checked`). Tensors that get
    new memory must fit in the memory available here; where they take more than half of it,
    the whole file is hashed first (a second pass), so a tensor a crafted header declares
    huge is never allocated unless the checksum vouches for it. ``root``: the file must be
    a regular file inside it (symlinks resolved)."""
    into = into or {}
    digest = _digest_for(path, expect)
    size = confine.check_regular(path, root)  # never a FIFO, a device, or a file outside the checkpoint
    if expect is not None and size != expect.get("size"):
        raise ChecksumError(checksum.mismatch(expect, {"size": size}, path))
    with _Sequential(path) as fh:
        size = fh.size  # of the file opened: the bound of every read below
        if expect is not None and size != expect.get("size"):
            raise ChecksumError(checksum.mismatch(expect, {"size": size}, path))
        try:
            out = _read_all(fh, path, size, into, digest, expect)
        except (ChecksumError, TooLargeError):
            raise
        except TensorFileError as err:
            if expect is None:
                raise
            # The size matched, so bytes that cannot be parsed are corrupted ones.
            raise ChecksumError(f"{path}: does not match the manifest (corrupted: {err})") from None
        finally:
            if digest is not None:
                digest.wait()  # no helper thread may still read the tensors when we return
    if expect is not None and digest is not None:
        problem = checksum.mismatch(expect, digest.entry(size), path)
        if problem:
            raise ChecksumError(problem)
    return out


def _digest_for(path: Path, expect: dict[str, Any] | None) -> TreeHash | None:
    """The hash of the algorithm ``expect`` names (None without ``expect``)."""
    if expect is None:
        return None
    algorithm = checksum.of_entry(expect)
    if algorithm is None:  # no key this version knows: nothing can vouch for the bytes
        raise ChecksumError(checksum.mismatch(expect, {"size": expect.get("size")}, path))
    return TreeHash(algorithm)


def _read_all(fh: Any, path: Path, size: int, into: dict[str, torch.Tensor],
              digest: TreeHash | None, expect: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    raw, header = _read_header(fh, path, size)
    entries = _checked(header, path, size - len(raw))
    if _check_memory(entries, into, path) and expect is not None and digest is not None:
        _verify_first(path, expect)  # raises ChecksumError before anything is allocated
    _update(digest, raw)
    pos = len(raw)
    for name, entry in sorted(entries.items(), key=lambda item: item[1]["data_offsets"][0]):
        begin, end = (len(raw) + offset for offset in entry["data_offsets"])
        if begin < pos:
            raise TensorFileError(f"{path}: tensor {name!r} has bad data_offsets {entry['data_offsets']} (overlap)")
        _update(digest, _read_bytes(fh, begin - pos, path))  # a gap (none in files written here)
        out[name] = target = _target(into.get(name), entry, name, path)
        _read_exact(fh, _bytes(target), path, digest)
        pos = end
    _update(digest, _read_bytes(fh, size - pos, path))  # trailing bytes count too
    return out


class _Sequential:
    """A file's bytes in order, as ``read`` / ``readinto``, each ``readinto`` one ``read(2)``
    straight into the caller's buffer (a live tensor: no bounce buffer, no copy in Python,
    the GIL released meanwhile), while the kernel's sequential readahead fetches the next
    bytes. What has been read is dropped from the page cache behind the reader, so loading a
    state the size of the node's memory evicts nothing else. Why not ``O_DIRECT`` (one
    request at a time, then a copy): on the 2-core development VM it read a 1 GB file at
    0.8-1.7 GB/s where these buffered reads reached 2.2-2.7 (docs/benchmarks.md)."""

    DROP = 64 << 20  # bytes between two page-cache drops

    def __init__(self, path: Path) -> None:
        self._fh = _open_read(path)
        fd = self._fh.fileno()
        self.size = os.fstat(fd).st_size
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)  # a larger readahead window
        self._pos = self._dropped = 0

    def readinto(self, dest: memoryview) -> int:
        n = self._fh.readinto(dest) or 0
        self._pos += n
        if self._pos - self._dropped >= self.DROP:
            self._drop()
        return n

    def read(self, n: int) -> bytes:
        data = self._fh.read(n) or b""
        self._pos += len(data)
        return data

    def _drop(self) -> None:
        os.posix_fadvise(self._fh.fileno(), self._dropped, self._pos - self._dropped, os.POSIX_FADV_DONTNEED)
        self._dropped = self._pos

    def __enter__(self) -> _Sequential:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self._drop()
        finally:
            self._fh.close()


def _open_read(path: Path) -> io.FileIO:
    """Opened non-blocking, a regular file only (:func:`confine.open_regular`)."""
    return confine.open_regular(path)[0]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _checked(header: dict[str, Any], path: Path, data_size: int) -> dict[str, Any]:
    """The header's entries once each is known to describe bytes of this file: a known
    dtype, a shape of non-negative ints, and two int offsets within the ``data_size`` bytes
    after the header whose difference is exactly the shape's bytes. Nothing is allocated
    before this passed."""
    for name, entry in header.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("shape"), list) \
                or not isinstance(entry.get("data_offsets"), list) or len(entry["data_offsets"]) != 2 \
                or not all(_is_int(n) for n in [*entry["shape"], *entry["data_offsets"]]):
            raise TensorFileError(f"{path}: header entry {_shown(name)} is malformed (crafted or corrupted)")
        if entry.get("dtype") not in _BY_NAME:
            raise TensorFileError(f"{path}: tensor {_shown(name)} has unknown dtype {_shown(entry.get('dtype'))}")
        shape, (begin, end) = entry["shape"], entry["data_offsets"]
        if any(n < 0 for n in shape):
            raise TensorFileError(f"{path}: tensor {_shown(name)} has negative dimensions {_shown(shape)} (crafted)")
        if not 0 <= begin <= end <= data_size:
            raise TensorFileError(f"{path}: tensor {_shown(name)} has bad data_offsets {[begin, end]} for the "
                                  f"{data_size:,} data bytes of the file")
        nbytes = math.prod(shape) * _ITEMSIZE[entry["dtype"]]
        if end - begin != nbytes:
            raise TensorFileError(f"{path}: tensor {_shown(name)} has {end - begin} bytes for shape {_shown(shape)}")
    return header


_ITEMSIZE = {name: torch.empty((), dtype=dtype).element_size() for name, dtype in _BY_NAME.items()}


def _fits(live: torch.Tensor | None, entry: dict[str, Any]) -> bool:
    return live is not None and tuple(live.shape) == tuple(entry["shape"]) and live.dtype == _BY_NAME[entry["dtype"]] \
        and live.is_contiguous() and live.device.type == "cpu"


def _target(live: torch.Tensor | None, entry: dict[str, Any], name: str, path: Path) -> torch.Tensor:
    """The live tensor if it fits the (checked) entry exactly, else a new one."""
    if live is not None and _fits(live, entry):
        return live
    return allocate(tuple(entry["shape"]), _BY_NAME[entry["dtype"]])


def allocate(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Every new tensor a read makes (one place, so tests can see what is allocated)."""
    return torch.empty(shape, dtype=dtype)


def available_memory() -> int:
    """Bytes this process may still allocate: the kernel's MemAvailable, or less where the
    cgroup (a Slurm job's, a container's) leaves less."""
    avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            avail = min(avail, int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text()))
    except (OSError, ValueError, IndexError):
        pass  # what is known so far
    return max(avail, 0)


def _check_memory(entries: dict[str, Any], into: dict[str, torch.Tensor], path: Path) -> bool:
    """Raise when the tensors that need new memory do not fit in what is available; True
    when they take more than half of it (then the checksum is checked before they are made)."""
    fresh = sum(end - begin for name, entry in entries.items() if not _fits(into.get(name), entry)
                for begin, end in [entry["data_offsets"]])
    if not fresh:
        return False
    avail = available_memory()
    if fresh > avail:
        raise TooLargeError(f"{path}: its tensors need {fresh:,} bytes of new memory, more than the {avail:,} "
                              "available here: not read (crafted, or a state too large for this node); hint: "
                              "`hpctrain ckpt verify` it, or resume on a node with more memory")
    return fresh > avail // 2


def _verify_first(path: Path, expect: dict[str, Any]) -> None:
    """Hash the whole file (a pass of its own, three 64 MiB buffers) and raise
    :class:`ChecksumError` where it does not match ``expect``."""
    problem = checksum.mismatch(expect, checksum.hash_file(path, checksum.of_entry(expect)), path)
    if problem:
        raise ChecksumError(problem)


def _update(digest: TreeHash | None, data: Any) -> None:
    if digest is not None and len(data):
        digest.update(data)


def _read_bytes(fh: Any, n: int, path: Path) -> bytes:
    data = fh.read(n) if n else b""
    if len(data) != n:
        raise TensorFileError(f"{path} is truncated")
    return data


def _read_exact(fh: Any, dest: memoryview, path: Path, digest: TreeHash | None = None) -> None:
    """Fill ``dest`` from ``fh``; each piece is handed to ``digest`` as soon as it is read,
    so hashing runs in the helper threads while the next piece is read."""
    done = 0
    while done < len(dest):
        n = fh.readinto(dest[done : done + CHUNK])
        if not n:
            raise TensorFileError(f"{path} is truncated")
        _update(digest, dest[done : done + n])
        done += n
