"""Fuzzers for the checkpoint's parsers of outside input (issue 25, point 2): manifests,
tensor-file headers and DCP metadata. Fixed seeds, a few hundred cases each, seconds in all.

The property, for every case: the reader returns, or raises an hpctrain error (UserError or
RunError: one line, exit 2 or 1); never another exception (a traceback), never a hang (each
case runs under an alarm), never an allocation above a bound (every tensor a read makes is
counted), never an open of a file outside the checkpoint (an audit hook sees every open; the
mutations point names and symlinks at a folder beside the checkpoint).
"""

from __future__ import annotations

import copy
import functools
import json
import os
import pickle
import random
import shutil
import struct
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hpctrain.checkpoint import layout, tensorfile
from hpctrain.checkpoint.state import REPLICATED_TENSORS
from hpctrain.cli.ckpt import _verify_one
from hpctrain.core.errors import HpctrainError
from hpctrain.parallel.state import SHARDED_DIR
from tests.checkpoint.test_crafted_reads import _train, deadline

CASES = int(os.environ.get("HPCTRAIN_FUZZ_CASES", "300"))  # benchmarks/faults.py runs more
SEED = int(os.environ.get("HPCTRAIN_FUZZ_SEED", "0"))
ALLOC_BOUND = 64 << 20  # bytes any one case may allocate for tensors (the real files hold ~100 KB)
_opened: list[str] = []
_watching = [False]


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if _watching[0] and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        _opened.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)  # cannot be removed: it records only while a case runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("fuzz")
    out = {}
    for fmt in ("torch", "dcp"):
        _train(base / fmt, f"checkpoint.format={fmt}")
        out[fmt] = layout.committed(base / fmt / "checkpoints")[-1][1]
    return out


@pytest.fixture
def bounded(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Tensor allocations of the reads, and a node with 256 MiB free (a declared tensor beyond it is refused)."""
    seen: list[int] = []
    real = tensorfile.allocate

    def spy(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        seen.append(int(torch.Size(shape).numel()) * dtype.itemsize)
        assert seen[-1] <= ALLOC_BOUND, f"allocated {seen[-1]:,} bytes"
        return real(shape, dtype)

    monkeypatch.setattr(tensorfile, "allocate", spy)
    monkeypatch.setattr(tensorfile, "available_memory", lambda: 256 << 20)
    yield seen


def _workspace(tmp_path: Path, ckpt: Path) -> tuple[Path, Path]:
    """A copy of ``ckpt`` and a folder beside it that no read may enter."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"x" * 100)
    work = tmp_path / "ckpt"
    shutil.copytree(ckpt, work)
    return work, outside


def _check_case(case: int, outside: Path, run: Callable[[], Any]) -> None:
    """``run`` returns or raises an HpctrainError, within the time, opening nothing outside."""
    _opened.clear()
    _watching[0] = True
    try:
        with deadline(20):
            run()
    except HpctrainError as err:
        assert "Traceback" not in str(err), f"case {case}: {err}"  # hpctrain's own message, not DCP's dump
    finally:
        _watching[0] = False
    bad = [p for p in _opened if os.path.realpath(p).startswith((str(outside), "/dev/", "/etc/"))]
    assert not bad, f"case {case} opened {bad}"


# ---------------------------------------------------------------- values and mutations


def _odd_value(rng: random.Random) -> Any:
    return rng.choice([None, True, -1, 0, 2**70, 1e400, -0.5, "", "x", "14313", [], [1, -4096], {}, {"a": 1},
                       "../../outside/secret", "/etc/passwd", [[[[[]]]]], "F32", "sharded/../../../../dev/zero"])


def _mutate_json(rng: random.Random, value: Any, depth: int = 0) -> Any:
    """A copy of ``value`` with one node replaced, deleted or added somewhere."""
    if isinstance(value, dict) and value and rng.random() < 0.7:
        key = rng.choice(list(value))
        out = dict(value)
        roll = rng.random()
        if roll < 0.15:
            del out[key]
        elif roll < 0.3:
            out[rng.choice(["../../outside/secret", "/etc/hostname", "a/../../b", "sharded/../x", ""])] = \
                {"size": 100, "xxh3_128_tree": "0" * 32}
        else:
            out[key] = _mutate_json(rng, value[key], depth + 1)
        return out
    if isinstance(value, list) and value and rng.random() < 0.7:
        out_list = list(value)
        i = rng.randrange(len(out_list))
        out_list[i] = _mutate_json(rng, out_list[i], depth + 1)
        return out_list
    return _odd_value(rng)


def _mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    out = bytearray(data)
    roll = rng.random()
    if roll < 0.2 and out:
        return bytes(out[: rng.randrange(len(out))])  # truncated
    for _ in range(rng.randint(1, 8)):
        if out:
            out[rng.randrange(len(out))] = rng.randrange(256)
    return bytes(out)


# ---------------------------------------------------------------- manifests


def test_fuzz_manifests(runs: dict[str, Path], tmp_path: Path, bounded: list[int]) -> None:
    work, outside = _workspace(tmp_path, runs["dcp"])
    original = (work / layout.MANIFEST).read_bytes()
    manifest = json.loads(original)
    (work / "link-out").symlink_to(outside / "secret")
    rng = random.Random(2501 + SEED)
    for case in range(CASES):
        if case % 3 == 2:
            text = _mutate_bytes(rng, original)
        else:
            mutated = _mutate_json(rng, manifest)
            if rng.random() < 0.1 and isinstance(mutated, dict) and isinstance(mutated.get("files"), dict):
                mutated["files"]["link-out"] = {"size": 100, "xxh3_128_tree": "0" * 32}
            text = json.dumps(mutated).encode()
        (work / layout.MANIFEST).write_bytes(text)
        _check_case(case, outside, lambda: (layout.verify(work), _verify_one(work)))
    assert not bounded or max(bounded) <= ALLOC_BOUND


def test_fuzz_deep_and_huge_manifests(runs: dict[str, Path], tmp_path: Path) -> None:
    work, outside = _workspace(tmp_path, runs["torch"])
    for case, text in enumerate([b"[" * 200_000 + b"]" * 200_000, b'{"files": ' * 100_000 + b"{}" + b"}" * 100_000,
                                 b'{"files": {"a": {"size": 1' + b"0" * 5000 + b"}}}", b"\xff\xfe", b""]):
        (work / layout.MANIFEST).write_bytes(text)
        _check_case(case, outside, lambda: layout.verify(work))
        assert layout.verify(work)  # a problem, not success


# ---------------------------------------------------------------- tensor-file headers


def _header_entries(rng: random.Random, data_size: int) -> dict[str, Any]:
    entries: dict[str, Any] = {}
    for i in range(rng.randint(0, 4)):
        dtype = rng.choice(["F32", "F16", "BF16", "I64", "U8", "BOOL", "F8", "f32", 7, None])
        shape = rng.choice([[], [3], [2, 5], [-1, -4096], [1 << 40], [0], [2**63], [1.5], "x", [[1]], [True]])
        begin = rng.choice([0, 8, -8, data_size, 1 << 50, 3])
        end = rng.choice([begin + 12, begin + 20, data_size, begin, begin - 4, 1 << 62])
        entries[f"t{i}"] = {"dtype": dtype, "shape": shape, "data_offsets": rng.choice([[begin, end], [begin], "x"])}
        if rng.random() < 0.1:
            entries[f"t{i}"] = _odd_value(rng)
    return entries


def test_fuzz_tensor_file_headers(runs: dict[str, Path], tmp_path: Path, bounded: list[int]) -> None:
    work, outside = _workspace(tmp_path, runs["torch"])
    path = work / REPLICATED_TENSORS
    original = path.read_bytes()
    rng = random.Random(2502 + SEED)
    for case in range(CASES):
        if case % 2:
            data = _mutate_bytes(rng, original)
        else:
            header = json.dumps(_header_entries(rng, 64)).encode()
            length = rng.choice([len(header), len(header), 1 << 50, 2**64 - 1, len(header) + 1, 0])
            data = struct.pack("<Q", length) + header + bytes(64)
        path.write_bytes(data)
        with_checksum = rng.random() < 0.5  # the manifest rewritten to match, or no manifest at all
        expect = layout.hash_file(path) if with_checksum else None
        _check_case(case, outside, functools.partial(tensorfile.read, path, None, expect, root=work))
    assert max(bounded, default=0) <= ALLOC_BOUND


# ---------------------------------------------------------------- DCP metadata


def _mutate_metadata(rng: random.Random, metadata: Any) -> Any:
    """A copy of DCP's Metadata with one size, offset, length or path changed."""
    out = copy.deepcopy(metadata)
    roll = rng.random()
    if roll < 0.4:
        key = rng.choice(sorted(k for k, m in out.state_dict_metadata.items() if hasattr(m, "size")))
        meta = out.state_dict_metadata[key]
        meta.size = torch.Size(rng.choice([[-1, -4096], [1 << 40], [0], [2**40, 2**40], [3]]))
    else:
        index = rng.choice(list(out.storage_data))
        info = out.storage_data[index]
        field = rng.choice(["offset", "length", "relative_path"])
        value = rng.choice([-1, 1 << 50, 0, 7]) if field != "relative_path" else \
            rng.choice(["../../outside/secret", "/etc/passwd", "..", "link-out", "missing.distcp", "fifo"])
        out.storage_data[index] = type(info)(**{**info.__dict__, field: value})
    return out


def test_fuzz_dcp_metadata(runs: dict[str, Path], tmp_path: Path, bounded: list[int]) -> None:
    from hpctrain.parallel import dcp_read
    from hpctrain.parallel.state import dcp_source

    work, outside = _workspace(tmp_path, runs["dcp"])
    sharded = work / SHARDED_DIR
    (sharded / "link-out").symlink_to(outside / "secret")
    os.mkfifo(sharded / "fifo")
    original = (sharded / ".metadata").read_bytes()
    metadata = dcp_read.read_metadata(sharded)
    rng = random.Random(2503 + SEED)

    def read() -> None:
        meta = dcp_read.read_metadata(sharded)
        dcp_read.check_items(sharded, meta)
        source = dcp_source(sharded)
        for tensor in source.tensors:
            del tensor
        assert source.live.peak <= ALLOC_BOUND

    for case in range(CASES // 3):
        if case % 2:
            data = _mutate_bytes(rng, original)
        else:
            data = pickle.dumps(_mutate_metadata(rng, metadata))
        (sharded / ".metadata").write_bytes(data)
        _check_case(case, outside, read)
