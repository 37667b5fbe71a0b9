"""Crafted checkpoints end in clear errors, never a crash, a hang or a blown memory (issue 17, point 5).

Three files, each a few KB and a valid ``torch.save`` zip that ``weights_only`` would load: a
20,000-deep nested list (``RecursionError`` in whatever walks it), a 64-level DAG of shared
lists (2**64 objects for whoever walks it as a tree) and a zip bomb (a 16 KB member declaring
16 MB; torch allocates what it declares). Each is planted as the newest checkpoint's skeleton
with the manifest rewritten to match, as whoever can write the checkpoint can do.
"""

from __future__ import annotations

import io
import json
import logging
import pickle
import shutil
import zipfile
from pathlib import Path

import pytest
import torch

from hpctrain.checkpoint import layout
from hpctrain.checkpoint.state import REPLICATED
from hpctrain.cli import main as cli_main
from hpctrain.config import load_config
from hpctrain.core import safe_pickle
from hpctrain.parallel import dcp_read
from hpctrain.train import train
from hpctrain.weights.load import load_weights_file

BASE = ["model.name=tests.ckpt_models:tiny_mlp", "data.name=synthetic_tiny", "data.synthetic_size=128",
        "data.batch_size=16", "data.max_val_samples=32", "train.epochs=1", "train.progress=false",
        "checkpoint.every_seconds=None", "train.threads=1", "checkpoint.every_steps=4", "checkpoint.keep_last=5"]


def _deep(levels: int = 20_000) -> bytes:
    """``[[[...]]]``: ``levels`` empty lists on the stack, each appended to the one below."""
    return b"\x80\x02" + b"]" * levels + b"a" * (levels - 1) + b"."


def _dag(levels: int = 64) -> bytes:
    """a0 = []; a_k = [a_(k-1), a_(k-1)]: 2**levels lists for a tree walk, from a few hundred bytes."""
    out = bytearray(b"\x80\x02]q\x00")
    for k in range(1, levels + 1):
        out += b"](h" + bytes([k - 1]) + b"h" + bytes([k - 1]) + b"eq" + bytes([k])
    return bytes(out + b".")


def _torch_zip(pkl: bytes, bomb: int = 0) -> bytes:
    """A torch.save zip around ``pkl``; with ``bomb`` bytes of zeros after its STOP, deflated."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED if bomb else zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/data.pkl", pkl + bytes(bomb))
        archive.writestr("archive/version", b"3\n")
        archive.writestr("archive/byteorder", b"little")
    return buf.getvalue()


CRAFTED = {
    "deep": (lambda: _torch_zip(_deep()), "nests 20000 levels deep"),
    "dag": (lambda: _torch_zip(_dag()), "unfolds into more than"),
    "zip-bomb": (lambda: _torch_zip(b"\x80\x02}q\x00.", bomb=16 << 20), "(a zip bomb)"),
}


def test_the_crafted_files_are_what_they_claim() -> None:
    """torch.load(weights_only=True) takes each of them (a guard on the test, not on hpctrain):
    only the limits stand between them and the resume."""
    for make, _ in CRAFTED.values():
        data = make()
        assert len(data) < 50_000
        torch.load(io.BytesIO(data), weights_only=True)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished one-process run with torch-format checkpoints at steps 4 and 8."""
    path = tmp_path_factory.mktemp("crafted") / "run"
    train(load_config(None, [*BASE, f"run.dir={path}"]))
    assert [s for s, _ in layout.committed(path / "checkpoints")] == [4, 8]
    return path


def _plant(run: Path, kind: str, where: Path) -> Path:
    """A copy of ``run`` whose newest checkpoint's skeleton is the crafted file, manifest matching."""
    shutil.copytree(run, where)
    newest = layout.committed(where / "checkpoints")[-1][1]
    (newest / REPLICATED).write_bytes(CRAFTED[kind][0]())
    manifest = json.loads((newest / layout.MANIFEST).read_text())
    manifest["files"][REPLICATED] = layout.hash_file(newest / REPLICATED)
    (newest / layout.MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    assert layout.verify(newest) == []  # consistent: only the limits can tell
    return newest


@pytest.mark.parametrize("kind", list(CRAFTED))
def test_resume_auto_skips_it_with_the_reason(run: Path, kind: str, tmp_path: Path,
                                              caplog: pytest.LogCaptureFixture) -> None:
    newest = _plant(run, kind, tmp_path / "run")
    (tmp_path / "run" / "summary.json").unlink()  # as if stopped: resume=auto takes the newest checkpoint
    with caplog.at_level(logging.WARNING, "hpctrain"):
        summary = train(load_config(None, [*BASE, f"run.dir={tmp_path / 'run'}", "resume=auto"]))
    assert f"{newest} is corrupt and is skipped" in caplog.text
    assert CRAFTED[kind][1] in caplog.text
    assert summary["steps"] == 8  # went on from step 4, the next older checkpoint


@pytest.mark.parametrize("kind", list(CRAFTED))
def test_verify_export_and_eval_refuse_it_with_exit_2(run: Path, kind: str, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    newest = _plant(run, kind, tmp_path / "run")
    capsys.readouterr()
    assert cli_main(["ckpt", "verify", str(newest)]) == 2
    out = capsys.readouterr().out
    assert "REFUSED" in out and CRAFTED[kind][1] in out
    assert cli_main(["ckpt", "export", str(newest), str(tmp_path / "out.pt")]) == 2
    err = capsys.readouterr().err
    assert CRAFTED[kind][1] in err and "Traceback" not in err
    assert not (tmp_path / "out.pt").exists()

    weights = newest / REPLICATED
    with pytest.raises(safe_pickle.UnsafePickleError, match=CRAFTED[kind][1].replace("(", r"\(").replace(")", r"\)")):
        load_weights_file(weights)
    tiny = ["model.name=tests.ckpt_models:tiny_mlp", "data.name=synthetic_tiny", "data.synthetic_size=32"]
    assert cli_main(["eval", *tiny, "--weights", str(weights), "--out", str(tmp_path / "eval")]) == 2
    err = capsys.readouterr().err
    assert str(weights) in err and "Traceback" not in err


def test_limits_leave_real_pickles_alone(run: Path) -> None:
    """A real skeleton nests far below the limit; nested and shared data within the limits loads."""
    with zipfile.ZipFile(layout.committed(run / "checkpoints")[-1][1] / REPLICATED) as archive:
        skeleton = archive.read(next(n for n in archive.namelist() if n.endswith("/data.pkl")))
    depth, _ = safe_pickle._measure(safe_pickle._graph(skeleton)[0], 10**9, "skeleton")
    assert depth <= 20 < safe_pickle.MAX_DEPTH
    safe_pickle.check_limits(pickle.dumps(_nested(safe_pickle.MAX_DEPTH - 1)), "ok")
    with pytest.raises(safe_pickle.UnsafePickleError, match=f"nests {safe_pickle.MAX_DEPTH + 1} levels"):
        safe_pickle.check_limits(pickle.dumps(_nested(safe_pickle.MAX_DEPTH)), "too deep")
    shared = [list(range(100))] * 1000  # one list referenced 1000 times: 101,001 objects from ~110 operations
    safe_pickle.check_limits(pickle.dumps(shared), "shared")
    cycle: list = []
    cycle.append(cycle)
    with pytest.raises(safe_pickle.UnsafePickleError, match="contains itself"):
        safe_pickle.check_limits(pickle.dumps(cycle), "cycle")


def _nested(levels: int) -> list:
    value: list = []
    for _ in range(levels):
        value = [value]
    return value


def test_dcp_metadata_and_items_are_held_to_the_limits(tmp_path: Path) -> None:
    """DCP's .metadata passes the same limits; its items must stay in the checkpoint directory
    and carry no extension's transform (a compression bomb's way in)."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(2)}, storage_writer=dcp.FileSystemWriter(str(tmp_path / "c")), no_dist=True)
    metadata = dcp_read.read_metadata(tmp_path / "c")
    dcp_read.check_items(tmp_path / "c", metadata)  # a real one passes
    (tmp_path / "c" / ".metadata").write_bytes(_dag())
    with pytest.raises(safe_pickle.UnsafePickleError, match="unfolds into more than"):
        dcp_read.read_metadata(tmp_path / "c")
    for field, value, reason in (("relative_path", "../../etc/passwd", "outside the checkpoint directory"),
                                 ("transform_descriptors", ["zstd"], "never writes")):
        info = next(iter(metadata.storage_data.values()))
        saved = getattr(info, field)
        setattr(info, field, value)
        (tmp_path / "c" / ".metadata").write_bytes(pickle.dumps(metadata))
        setattr(info, field, saved)
        with pytest.raises(safe_pickle.UnsafePickleError, match=reason):
            dcp_read.read_metadata(tmp_path / "c")
    info = next(iter(metadata.storage_data.values()))
    item = tmp_path / "c" / info.relative_path
    bomb = _torch_zip(b"\x80\x02}q\x00.", bomb=16 << 20)
    item.write_bytes(item.read_bytes()[: info.offset] + bomb)
    info.length = len(bomb)
    with pytest.raises(safe_pickle.UnsafePickleError, match="zip bomb"):
        dcp_read.check_items(tmp_path / "c", metadata)
