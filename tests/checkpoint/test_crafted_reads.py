"""Every read of a checkpoint is bounded and confined (issue 25, point 1).

Each crafted checkpoint of the issue is planted as the newest of a finished run (steps 4 and
8), its manifest rewritten where the attack needs it (whoever can write the directory can):
``ckpt verify`` names it and exits non-zero without a traceback, ``ckpt list --verify`` exits
non-zero, and ``resume=auto`` skips it with the reason and trains on from step 4. Nothing
blocks (a FIFO), reads forever (``/dev/urandom``), reads outside the directory, or allocates
what a header declares before the checksum vouches for it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hpctrain.checkpoint import confine, layout, tensorfile
from hpctrain.checkpoint.state import REPLICATED_TENSORS, rank_file
from hpctrain.cli import main as cli_main
from hpctrain.config import load_config
from hpctrain.parallel.state import SHARDED_DIR
from hpctrain.train import train
from hpctrain.weights.load import UnreadableWeightsError, load_weights_file
from tests.checkpoint.test_crafted import BASE

TIB = 1 << 40
UP = 32  # "../" that far up from any test's checkpoint reaches "/"


@contextlib.contextmanager
def deadline(seconds: float = 60) -> Iterator[None]:
    """Fail (never hang) when the block runs past ``seconds``: SIGALRM interrupts a blocked open."""
    def expired(*_: Any) -> None:
        raise AssertionError(f"still running after {seconds} s: a read blocked or never ends")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _train(run_dir: Path, *extra: str) -> dict[str, Any]:
    return train(load_config(None, [*BASE, f"run.dir={run_dir}", *extra]))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Finished one-process runs, torch and dcp format, each with checkpoints at steps 4 and 8."""
    base = tmp_path_factory.mktemp("crafted-reads")
    out = {}
    for fmt in ("torch", "dcp"):
        _train(base / fmt, f"checkpoint.format={fmt}")
        assert [s for s, _ in layout.committed(base / fmt / "checkpoints")] == [4, 8]
        out[fmt] = base / fmt
    return out


def _manifest(ckpt: Path) -> dict[str, Any]:
    return json.loads((ckpt / layout.MANIFEST).read_text())


def _write_manifest(ckpt: Path, manifest: dict[str, Any]) -> None:
    (ckpt / layout.MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def _rehash(ckpt: Path, name: str) -> None:
    """The manifest rewritten to match the (crafted) file: only the reader's checks can tell."""
    manifest = _manifest(ckpt)
    manifest["files"][name] = layout.hash_file(ckpt / name)
    _write_manifest(ckpt, manifest)


def _tensor_file(ckpt: Path, header: bytes, data_size: int, sparse: bool = False) -> None:
    """replicated.safetensors replaced by ``header`` (its length prefix added) and ``data_size`` bytes."""
    path = ckpt / REPLICATED_TENSORS
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(header)) + header)
        if sparse:
            fh.truncate(8 + len(header) + data_size)
        else:
            fh.write(bytes(data_size))


def fifo(ckpt: Path) -> str:
    target = ckpt / SHARDED_DIR / "__0_0.distcp"
    target.unlink()
    os.mkfifo(target)
    return "FIFO, not a regular file"


def urandom(ckpt: Path) -> str:
    target = ckpt / SHARDED_DIR / "__0_0.distcp"
    target.unlink()
    target.symlink_to("/dev/urandom")
    return "leads outside the checkpoint directory"


def dev_zero(ckpt: Path) -> str:
    manifest = _manifest(ckpt)
    manifest["files"]["sharded/" + "../" * UP + "dev/zero"] = {"size": 1 << 20, "xxh3_128_tree": "0" * 32}
    _write_manifest(ckpt, manifest)
    return "not a file inside the checkpoint directory"


def outside_names(ckpt: Path) -> str:
    manifest = _manifest(ckpt)
    for name in ("../" * UP + "etc/hostname", "/etc/passwd"):
        manifest["files"][name] = layout.hash_file(Path("/etc") / Path(name).name)  # the real size and checksum
    _write_manifest(ckpt, manifest)
    return "not a file inside the checkpoint directory"


def sparse_rank_file(ckpt: Path) -> str:
    with open(ckpt / rank_file(0), "r+b") as fh:
        fh.truncate(TIB)
    return "(truncated or overwritten)"


def sparse_rank_file_matching(ckpt: Path) -> str:
    sparse_rank_file(ckpt)
    manifest = _manifest(ckpt)
    manifest["files"][rank_file(0)]["size"] = TIB  # the checksum cannot be rewritten in a test's time
    _write_manifest(ckpt, manifest)
    return "refused before reading"


def header_length(ckpt: Path) -> str:
    path = ckpt / REPLICATED_TENSORS
    data = bytearray(path.read_bytes())
    data[:8] = struct.pack("<Q", 1 << 50)
    path.write_bytes(bytes(data))
    _rehash(ckpt, REPLICATED_TENSORS)
    return "header length 1,125,899,906,842,624"


def deep_header(ckpt: Path) -> str:
    _tensor_file(ckpt, b"[" * 200_000 + b"]" * 200_000, 64)
    _rehash(ckpt, REPLICATED_TENSORS)
    return "header nests deeper"


def negative_dims(ckpt: Path) -> str:
    header = json.dumps({"x": {"dtype": "F32", "shape": [-1, -4096], "data_offsets": [0, 4096 * 4]}}).encode()
    _tensor_file(ckpt, header, 4096 * 4)
    _rehash(ckpt, REPLICATED_TENSORS)
    return "negative dimensions [-1, -4096]"


def huge_tensor(ckpt: Path) -> str:
    """A 64 GiB U8 tensor in a sparse file, size in the manifest matching, checksum not."""
    header = json.dumps({"x": {"dtype": "U8", "shape": [64 << 30], "data_offsets": [0, 64 << 30]}}).encode()
    _tensor_file(ckpt, header, 64 << 30, sparse=True)
    manifest = _manifest(ckpt)
    manifest["files"][REPLICATED_TENSORS]["size"] = (ckpt / REPLICATED_TENSORS).stat().st_size
    _write_manifest(ckpt, manifest)
    return "bytes of new memory"


def _manifest_edit(edit: Callable[[dict[str, Any]], None], says: str) -> Callable[[Path], str]:
    def plant(ckpt: Path) -> str:
        manifest = _manifest(ckpt)
        edit(manifest)
        _write_manifest(ckpt, manifest)
        return says

    return plant


CRAFTED: dict[str, tuple[str, Callable[[Path], str]]] = {
    "fifo": ("dcp", fifo),
    "urandom": ("dcp", urandom),
    "dev_zero": ("dcp", dev_zero),
    "outside_names": ("torch", outside_names),
    "sparse_rank_file": ("torch", sparse_rank_file),
    "sparse_rank_file_matching": ("torch", sparse_rank_file_matching),
    "header_length": ("torch", header_length),
    "deep_header": ("torch", deep_header),
    "negative_dims": ("torch", negative_dims),
    "huge_tensor": ("torch", huge_tensor),
    "files_list": ("torch", _manifest_edit(lambda m: m.update(files=[]), "'files' is a list")),
    "entry_string": ("torch", _manifest_edit(lambda m: m["files"].update({rank_file(0): "x"}),
                                             "is a string (\"x\"), not an object")),
    "size_string": ("torch", _manifest_edit(lambda m: m["files"][rank_file(0)].update(size="14313"),
                                            "size is \"14313\", not a byte count")),
}


def _plant(runs: dict[str, Path], kind: str, where: Path) -> tuple[Path, str]:
    fmt, plant = CRAFTED[kind]
    shutil.copytree(runs[fmt], where, symlinks=True)
    newest = layout.committed(where / "checkpoints")[-1][1]
    return newest, plant(newest)


@pytest.fixture
def allocations(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Bytes of every tensor a checkpoint read allocates."""
    seen: list[int] = []
    real = tensorfile.allocate

    def spy(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        seen.append(int(torch.Size(shape).numel()) * dtype.itemsize)
        return real(shape, dtype)

    monkeypatch.setattr(tensorfile, "allocate", spy)
    return seen


@pytest.mark.parametrize("kind", [k for k in CRAFTED if k != "huge_tensor"])  # verify hashes its 64 GiB: bounded
def test_verify_and_list_name_it_and_exit_non_zero(runs: dict[str, Path], kind: str, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    newest, says = _plant(runs, kind, tmp_path / "run")
    capsys.readouterr()
    with deadline():
        assert cli_main(["ckpt", "verify", str(newest)]) in (1, 2)
    out, err = capsys.readouterr()
    assert says in out and "Traceback" not in out + err and "internal error" not in out + err
    assert f"{newest}: ok" not in out
    with deadline():
        assert cli_main(["ckpt", "list", "--verify", str(tmp_path / "run")]) in (1, 2)
    out, err = capsys.readouterr()
    assert "step-000000004" in out and "Traceback" not in out + err


@pytest.mark.parametrize("kind", list(CRAFTED))
def test_resume_auto_skips_it_and_goes_on_from_the_older_one(runs: dict[str, Path], kind: str, tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture,
                                                             allocations: list[int],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    memory = min(tensorfile.available_memory(), 16 << 30)  # the same on any machine: 64 GiB never fits
    monkeypatch.setattr(tensorfile, "available_memory", lambda: memory)
    newest, says = _plant(runs, kind, tmp_path / "run")
    fmt = CRAFTED[kind][0]
    (tmp_path / "run" / "summary.json").unlink()  # as if stopped: resume=auto takes the newest checkpoint
    with caplog.at_level(logging.WARNING, "hpctrain"), deadline():
        summary = _train(tmp_path / "run", "resume=auto", f"checkpoint.format={fmt}")
    assert f"{newest} is corrupt and is skipped" in caplog.text and says in caplog.text
    assert summary["steps"] == 8  # went on from step 4
    assert max(allocations, default=0) < 1 << 20  # tiny_mlp's tensors; nothing a header declared


def test_ckpt_verify_never_shows_a_file_outside(runs: dict[str, Path], tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    newest, _ = _plant(runs, "outside_names", tmp_path / "run")
    capsys.readouterr()
    assert cli_main(["ckpt", "verify", str(newest)]) == 1
    out = capsys.readouterr().out
    assert "CORRUPT" in out and "ok" not in out.split()
    real = Path("/etc/hostname").stat().st_size
    assert f"size {real}" not in out and f"{real} !=" not in out


def test_ckpt_list_shows_a_bad_manifest_and_the_others(runs: dict[str, Path], tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    _plant(runs, "size_string", tmp_path / "run")
    capsys.readouterr()
    assert cli_main(["ckpt", "list", str(tmp_path / "run")]) == 1
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("step-")}
    assert lines["step-000000004"].rstrip().endswith("committed") and " CORRUPT" in lines["step-000000008"]


def test_list_verify_exits_0_on_intact_checkpoints(runs: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["ckpt", "list", "--verify", str(runs["dcp"])]) == 0
    assert capsys.readouterr().out.count(" ok") == 2


def test_a_large_declared_tensor_is_hashed_before_it_is_allocated(runs: dict[str, Path], tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch,
                                                                  allocations: list[int]) -> None:
    """Where the memory would hold it, a tensor taking more than half of it is allocated only
    once the whole file's checksum matched: a wrong one is refused with nothing allocated."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    header = json.dumps({"x": {"dtype": "U8", "shape": [256 << 20], "data_offsets": [0, 256 << 20]}}).encode()
    _tensor_file(ckpt, header, 256 << 20, sparse=True)
    expect = {"size": (ckpt / REPLICATED_TENSORS).stat().st_size, "crc32_tree": "00000000"}
    monkeypatch.setattr(tensorfile, "available_memory", lambda: 300 << 20)
    with pytest.raises(tensorfile.ChecksumError, match="checksum"):
        tensorfile.read(ckpt / REPLICATED_TENSORS, None, expect, root=ckpt)
    assert allocations == []
    expect = layout.hash_file(ckpt / REPLICATED_TENSORS)  # matching: read, in two passes
    out = tensorfile.read(ckpt / REPLICATED_TENSORS, None, expect, root=ckpt)
    assert allocations == [256 << 20] and out["x"].shape == (256 << 20,)


def test_eval_weights_refuses_a_fifo_without_blocking(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    os.mkfifo(tmp_path / "w.pt")
    with deadline(30), pytest.raises(UnreadableWeightsError, match="not a regular file"):
        load_weights_file(tmp_path / "w.pt")
    tiny = ["model.name=tests.ckpt_models:tiny_mlp", "data.name=synthetic_tiny", "data.synthetic_size=32"]
    with deadline(60):
        assert cli_main(["eval", *tiny, "--weights", str(tmp_path / "w.pt"), "--out", str(tmp_path / "e")]) == 2
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["fifo", "urandom", "header_length", "files_list"])
def test_export_refuses_it(runs: dict[str, Path], kind: str, tmp_path: Path,
                           capsys: pytest.CaptureFixture[str]) -> None:
    newest, _ = _plant(runs, kind, tmp_path / "run")
    with deadline():
        assert cli_main(["ckpt", "export", str(newest), str(tmp_path / "out.pt")]) in (1, 2)
    assert "Traceback" not in capsys.readouterr().err and not (tmp_path / "out.pt").exists()


def test_confine_refuses_names_and_files_outside(tmp_path: Path) -> None:
    for name in ("../x", "/etc/passwd", "a/../../x", "", "a//b", "./a", 3):
        with pytest.raises(confine.RefusedFileError, match="not a file inside"):
            confine.member(tmp_path, name)
    assert confine.member(tmp_path, "sharded/__0_0.distcp") == tmp_path / "sharded" / "__0_0.distcp"
    (tmp_path / "out").symlink_to("/etc/hostname")
    with pytest.raises(confine.RefusedFileError, match="leads outside"):
        confine.open_regular(tmp_path / "out", tmp_path)
    (tmp_path / "in").write_bytes(b"abc")
    (tmp_path / "link").symlink_to(tmp_path / "in")  # a symlink inside the directory is fine
    fh, size = confine.open_regular(tmp_path / "link", tmp_path)
    with fh:
        assert size == 3 and fh.read() == b"abc"
