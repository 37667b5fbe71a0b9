"""Fuzzers for the shard readers (issue 25, point 2): mutated shard indexes, shard manifests and
tar members, fixed seeds, a few hundred cases each. The property, for every case: the loader,
``hpctrain data verify``/``inspect`` and the tar indexer either work or raise hpctrain's own error
(one line, exit 1 or 2), never another exception (a traceback), never a hang (the timeout mark),
never a large allocation (tracemalloc's peak) and never an open outside the data directory (an
audit hook records every ``open``)."""

from __future__ import annotations

import copy
import json
import random
import sys
import tarfile
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hpctrain.core.errors import HpctrainError
from hpctrain.data.indexing import index_existing, index_tar
from hpctrain.data.manifest import manifest_path, summarize
from hpctrain.data.pack import cls_bytes, npy_bytes
from hpctrain.data.shard_dataset import ShardDataset
from hpctrain.data.shard_index import ShardIndex
from hpctrain.data.verify import verify
from hpctrain.data.writer import write_shards

CASES = 250
TAR_CASES = 150  # each also writes an index and a manifest (fsynced)
PEAK_BYTES = 64 * 2**20  # the data is a few kB: anything near this was allocated from a crafted size
NASTY: list[Any] = [-1, -(2**40), 0, 2**31, 2**40, 2**63, 2**70, 1.5, float("nan"), True, None, "", "x", "12",
                    "../../outside.tar", "/etc/passwd", "..", ".", "a/b", "\x00", "é" * 500, [], {}, [1, 2],
                    "../outside/train-000000.tar", "../outside/train-000000.idx.json", "../outside",
                    [[-1, 2**62]], {"a": 1}, [None], ["x"] * 3]


# ---------------------------------------------------------------- the property


_OPENED: list[str] = []
_RECORDING: list[bool] = [False]


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event == "open" and _RECORDING[0] and isinstance(args[0], (str, bytes, Path)):
        _OPENED.append(str(args[0] if not isinstance(args[0], bytes) else args[0].decode(errors="replace")))


if not getattr(sys, "_hpctrain_shard_fuzz_hook", False):  # audit hooks cannot be removed: one per process
    sys.addaudithook(_audit)
    sys._hpctrain_shard_fuzz_hook = True  # type: ignore[attr-defined]


def _outside(root: Path) -> list[str]:
    """Files opened (not imported code) that are not under ``root``."""
    base = str(root.resolve())
    code = (".py", ".pyc", ".so", ".pth")
    return [p for p in _OPENED if not p.endswith(code) and not str(Path(p).resolve()).startswith(base)
            and not p.startswith(sys.prefix)]


def _run_cases(root: Path, cases: Iterator[Callable[[], None]]) -> dict[str, int]:
    """Run every case under the property; returns how many ended how (ok / hpctrain error)."""
    counts = {"ok": 0, "refused": 0}
    _OPENED.clear()
    tracemalloc.start()
    _RECORDING[0] = True
    try:
        for case in cases:
            try:
                case()
                counts["ok"] += 1
            except HpctrainError as err:
                assert "\n" not in str(err), str(err)  # one line
                counts["refused"] += 1
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        _RECORDING[0] = False
        tracemalloc.stop()
    assert peak < PEAK_BYTES, f"peak allocation {peak} bytes"
    assert _outside(root) == [], _outside(root)[:5]
    return counts


def _read_everything(root: Path) -> None:
    """What training, ``data verify`` and ``data inspect`` do with a split."""
    try:
        dataset = ShardDataset(ShardIndex(root, "train"), on_corrupt="skip")
        dataset.batch(list(range(len(dataset))))
    finally:
        verify_problems = verify(root, "train")
        summarize(root)
    assert isinstance(verify_problems, list)


# ---------------------------------------------------------------- mutations


def _paths(obj: Any, here: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield here
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, (*here, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:6]):
            yield from _paths(v, (*here, i))


def _mutate_json(obj: Any, rng: random.Random) -> bytes:
    """One structural mutation of a JSON document (a value replaced, a key dropped, a list cut or
    grown), or a byte-level one (cut, flipped byte, bad UTF-8, deep nesting)."""
    kind = rng.random()
    if kind < 0.15:
        text = json.dumps(obj).encode()
        choice = rng.randrange(4)
        if choice == 0:
            return text[: rng.randrange(len(text))]
        if choice == 1:
            pos = rng.randrange(len(text))
            return text[:pos] + bytes([rng.randrange(256)]) + text[pos + 1 :]
        if choice == 2:
            return b"\xff\xfe" + text
        return b"[" * 100_000 + b"]" * 100_000
    obj = copy.deepcopy(obj)
    for _ in range(rng.choice((1, 1, 2, 3))):
        path = rng.choice([p for p in _paths(obj) if p])
        parent = obj
        for step in path[:-1]:
            parent = parent[step]
        last = path[-1]
        action = rng.random()
        if action < 0.15 and isinstance(parent, dict):
            del parent[last]
        elif action < 0.3 and isinstance(parent[last], list) and parent[last]:
            parent[last] = parent[last][: rng.randrange(len(parent[last]))] if rng.random() < 0.5 \
                else parent[last] + parent[last][:1]
        elif action < 0.5 and isinstance(parent[last], int) and not isinstance(parent[last], bool):
            parent[last] = rng.choice((-1, 1, 511, 512, -512, 2**40)) + (0 if rng.random() < 0.5 else parent[last])
        else:
            parent[last] = copy.deepcopy(rng.choice(NASTY))
    return json.dumps(obj).encode()


# ---------------------------------------------------------------- fixtures


def _samples(n: int) -> Iterator[tuple[str, dict[str, bytes]]]:
    for i in range(n):
        yield f"s{i:04d}", {"npy": npy_bytes(np.full(3, i, np.float32)), "cls": cls_bytes(i % 3)}


@pytest.fixture
def shards(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    """data/ with two shards of 4 samples and a tar outside it (the bait); the pristine files."""
    root = tmp_path / "data"
    write_shards(_samples(8), root, "train", samples_per_shard=4,
                 meta={"classes": ["0", "1", "2"], "decode": {"input": "npy", "target": "cls"}})
    write_shards(_samples(4), tmp_path / "outside", "train", samples_per_shard=4)
    return root, {p.name: p.read_bytes() for p in root.iterdir()}


# ---------------------------------------------------------------- the fuzzers


@pytest.mark.timeout(120)
def test_fuzzed_shard_indexes_never_crash_allocate_or_read_outside(shards):
    root, pristine = shards
    rng = random.Random(20251126)
    index = json.loads(pristine["train-000001.idx.json"])

    def cases() -> Iterator[Callable[[], None]]:
        for _ in range(CASES):  # readers write nothing: only the mutated file changes
            (root / "train-000001.idx.json").write_bytes(_mutate_json(index, rng))
            yield lambda: _read_everything(root)

    counts = _run_cases(root, cases())
    assert counts["ok"] + counts["refused"] == CASES and counts["refused"] > CASES // 2, counts


@pytest.mark.timeout(120)
def test_fuzzed_shard_manifests_never_crash_allocate_or_read_outside(shards):
    root, pristine = shards
    rng = random.Random(4711)
    manifest = json.loads(pristine["train.manifest.json"])

    def cases() -> Iterator[Callable[[], None]]:
        for _ in range(CASES):
            manifest_path(root, "train").write_bytes(_mutate_json(manifest, rng))
            yield lambda: _read_everything(root)

    counts = _run_cases(root, cases())
    assert counts["ok"] + counts["refused"] == CASES and counts["refused"] > CASES // 2, counts


def _member(name: str, size: int, data: bytes, fmt: int, rng: random.Random) -> bytes:
    info = tarfile.TarInfo(name)
    info.size = size
    if fmt == tarfile.PAX_FORMAT and rng.random() < 0.5:
        info.pax_headers = {"comment": "x" * rng.randrange(0, 2000)}
    header = info.tobuf(fmt, "utf-8", "surrogateescape")  # type: ignore[arg-type]  # fmt: one of the three
    return header + data + b"\0" * (-len(data) % 512)


def _header_with(block: bytes, field: slice, value: bytes) -> bytes:
    """A 512-byte header with one field replaced and its checksum made right again (tarfile then
    believes it)."""
    raw = bytearray(block[:512])
    raw[field] = value.ljust(field.stop - field.start, b"\0")[: field.stop - field.start]
    raw[148:156] = b" " * 8
    raw[148:156] = b"%06o\0 " % sum(raw)
    return bytes(raw) + block[512:]


def _fuzzed_tar(rng: random.Random) -> bytes:
    """A tar of two or three samples (image-less .npy + .cls/.json), written in USTAR, GNU or PAX,
    with one lie: a member's size (octal or base-256, up to 2^62), a long name, a type flag,
    a cut, a flipped byte, or a .json/.cls with odd content."""
    fmt = rng.choice((tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT))
    members = []
    for i in range(rng.randrange(1, 4)):
        body = npy_bytes(np.full(2, i, np.float32))
        label = rng.choice((b"1", b"-3", b"x", b"9" * 5000, b'{"label": 2}', b"[" * 5000))
        members += [(f"k{i}.npy", body), (f"k{i}.{rng.choice(('cls', 'json', 'cls'))}", label)]
    blocks = [_member(name, len(data), data, fmt, rng) for name, data in members]
    lie, at = rng.randrange(7), rng.randrange(len(blocks))
    if lie == 0:  # a size: huge octal, base-256, or just too large for the file
        size = rng.choice((100 * 2**30, 2**33 - 1, 2**62, len(blocks[at]) * 3))
        value = b"%011o" % size if size < 8**11 else b"\x80" + size.to_bytes(11, "big")
        blocks[at] = _header_with(blocks[at], slice(124, 136), value)
    elif lie == 1:  # a GNU long name or PAX header declaring far more than follows
        kind = rng.choice((b"L", b"x", b"g", b"K"))
        blocks.insert(at, _header_with(_member("././@LongLink", 2**40, b"abc", tarfile.GNU_FORMAT, rng),
                                       slice(156, 157), kind))
    elif lie == 2:
        blocks[at] = _header_with(blocks[at], slice(156, 157), bytes([rng.randrange(256)]))
    elif lie == 3:
        blocks[at] = _header_with(blocks[at], slice(0, 100), rng.choice((b"../../x.cls", b"/etc/passwd", b"a..b.c",
                                                                         b"", b"\xff\xfe.cls")))
    data = b"".join(blocks) + b"\0" * 1024
    if lie == 4:
        data = data[: rng.randrange(len(data))]
    elif lie == 5:
        pos = rng.randrange(len(data))
        data = data[:pos] + bytes([rng.randrange(256)]) + data[pos + 1 :]
    return data


@pytest.mark.timeout(120)
def test_fuzzed_tar_members_never_crash_allocate_or_read_outside(tmp_path):
    root = tmp_path / "tars"
    root.mkdir()
    rng = random.Random(1234)
    tar = root / "train-000000.tar"

    def case() -> None:
        for old in root.glob("*.json"):
            old.unlink()
        index_tar(tar)
        index_existing(root, "train")
        _read_everything(root)

    def cases() -> Iterator[Callable[[], None]]:
        for _ in range(TAR_CASES):
            tar.write_bytes(_fuzzed_tar(rng))
            yield case

    counts = _run_cases(root, cases())
    assert counts["ok"] + counts["refused"] == TAR_CASES and counts["refused"] > TAR_CASES // 4, counts
    assert counts["ok"] > 0, counts  # some tars survive their lie (a bad label is skipped, not fatal)


def test_the_fuzz_property_catches_what_it_claims(tmp_path):
    """The harness itself: an open outside the directory, a large allocation and a foreign
    exception are each caught."""
    root = tmp_path / "d"
    root.mkdir()
    (tmp_path / "secret").write_text("x")
    with pytest.raises(AssertionError, match="secret"):
        _run_cases(root, iter([lambda: (tmp_path / "secret").read_text() and None]))
    with pytest.raises(AssertionError, match="peak allocation"):
        _run_cases(root, iter([lambda: bytearray(PEAK_BYTES * 2) and None]))
    with pytest.raises(ZeroDivisionError):
        _run_cases(root, iter([lambda: 1 // 0 and None]))
