"""A checkpoint or a data file handed over by someone else never runs code (issue 17, point 0).

Each payload, if unpickled by plain ``pickle``, would create a marker file: every test
asserts the marker is absent, so a regression that runs the payload fails here. The
checkpoint's manifest is rewritten to match the planted file, as whoever can write the
checkpoint directory could do: checksums alone cannot tell it from a real one.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from hpctrain.checkpoint import layout
from hpctrain.cli import main as cli_main
from hpctrain.config import load_config
from hpctrain.core import safe_pickle
from hpctrain.parallel.state import SHARDED_DIR
from hpctrain.train import train

BASE = ["model.name=tests.ckpt_models:tiny_mlp", "data.name=synthetic_tiny", "data.synthetic_size=128",
        "data.batch_size=16", "data.max_val_samples=32", "train.epochs=1", "train.progress=false",
        "checkpoint.every_seconds=None", "train.threads=1", "checkpoint.format=dcp", "checkpoint.every_steps=4",
        "checkpoint.keep_last=5"]


class _Payload:
    """Pickles as a call of ``os.system`` that creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


def _plant(file: Path, data: bytes, ckpt: Path) -> None:
    """Write ``data`` as ``file`` of checkpoint ``ckpt`` and make the manifest agree with it."""
    file.write_bytes(data)
    manifest = json.loads((ckpt / layout.MANIFEST).read_text())
    manifest["files"][file.relative_to(ckpt).as_posix()] = layout.hash_file(file)
    (ckpt / layout.MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    assert layout.verify(ckpt) == []  # consistent: only reading the pickle safely can catch it


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A finished one-process run with DCP checkpoints at steps 4 and 8; the newest one's
    ``.metadata`` replaced by a payload. Returns (run dir, marker path)."""
    root = tmp_path_factory.mktemp("planted")
    run, marker = root / "run", root / "PWNED"
    train(load_config(None, [*BASE, f"run.dir={run}"]))
    newest = layout.committed(run / "checkpoints")[-1][1]
    _plant(newest / SHARDED_DIR / ".metadata", pickle.dumps(_Payload(marker)), newest)
    return run, marker


def test_resume_auto_skips_the_planted_checkpoint_without_running_it(planted: tuple[Path, Path], tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    run, marker = tmp_path / "run", planted[1]
    shutil.copytree(planted[0], run)  # the other tests read the planted run as it is
    (run / "summary.json").unlink()  # as if the run had been stopped: resume=auto picks the newest checkpoint
    steps = [s for s, _ in layout.committed(run / "checkpoints")]
    summary = train(load_config(None, [*BASE, f"run.dir={run}", "resume=auto", "train.epochs=2"]))
    assert not marker.exists()
    assert f"step-{steps[-1]:09d} is corrupt and is skipped" in caplog.text
    assert "posix.system" in caplog.text or "os.system" in caplog.text  # the reason names the refused global
    assert summary["steps"] == 16  # went on from the previous checkpoint to the end of epoch 2


def test_ckpt_verify_and_export_refuse_it_with_exit_2(planted: tuple[Path, Path], tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    run, marker = planted
    newest = layout.committed(run / "checkpoints")[-1][1]
    assert cli_main(["ckpt", "verify", str(newest)]) == 2
    assert "REFUSED" in capsys.readouterr().out
    assert cli_main(["ckpt", "export", str(newest), str(tmp_path / "out.pt")]) == 2
    assert "refused without running it" in capsys.readouterr().err
    assert not marker.exists() and not (tmp_path / "out.pt").exists()


def test_ckpt_verify_refuses_a_payload_in_a_replicated_file_with_right_hashes(
        planted: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run, marker = planted
    older = tmp_path / "older"
    shutil.copytree(layout.committed(run / "checkpoints")[0][1], older)
    name = sorted(n for n in json.loads((older / layout.MANIFEST).read_text())["files"]
                  if "/" not in n and n.endswith(".pt"))[0]
    archive = io.BytesIO()
    torch.save({"model": _Payload(marker)}, archive)  # a real torch archive: its limits alone pass it
    _plant(older / name, archive.getvalue(), older)
    assert cli_main(["ckpt", "verify", str(older)]) == 2
    assert "REFUSED" in capsys.readouterr().out
    assert not marker.exists()


def test_a_non_tensor_value_of_a_dcp_checkpoint_is_read_weights_only(tmp_path: Path) -> None:
    """DCP's default planner reads non-tensor values (lr, param groups) with
    ``torch.load(weights_only=False)``; hpctrain's planner loads plain values as before and
    refuses a payload there too."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    from hpctrain.parallel import dcp_read

    dcp.save({"lr": 0.5, "w": torch.ones(2)}, storage_writer=dcp.FileSystemWriter(str(tmp_path / "c")),
             no_dist=True)
    state: dict = {"lr": 0.0, "w": torch.zeros(2)}
    dcp_read.load(state, tmp_path / "c", no_dist=True)
    assert state["lr"] == 0.5 and state["w"].tolist() == [1.0, 1.0]

    marker, payload = tmp_path / "PWNED", io.BytesIO()
    torch.save(_Payload(marker), payload)
    none = torch.Size([0])
    item = ReadItem(type=LoadItemType.BYTE_IO, dest_index=MetadataIndex("lr"), dest_offsets=none,
                    storage_index=MetadataIndex("lr"), storage_offsets=none, lengths=none)
    with pytest.raises(safe_pickle.UnsafePickleError, match="not plain data"):
        dcp_read.SafePlanner().load_bytes(item, io.BytesIO(payload.getvalue()))
    assert not marker.exists()


def test_mnist_path_with_a_payload_exits_2_without_running_it(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    marker, evil = tmp_path / "PWNED", tmp_path / "evil.pkl.gz"
    with gzip.open(evil, "wb") as fh:
        pickle.dump(_Payload(marker), fh)
    code = cli_main(["train", "data.name=mnist", f"data.path={evil}", f"run.dir={tmp_path / 'run'}",
                     "train.progress=false"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert str(evil) in err and "refused without running it" in err and "Traceback" not in err
    assert not marker.exists()


def test_the_mnist_reader_still_reads_numpy_arrays(tmp_path: Path) -> None:
    """What mnist.pkl.gz holds (three (images, labels) pairs of numpy arrays) passes the
    restriction; a pickle of something else that is harmless is refused as not MNIST."""
    from hpctrain.data.mnist import load_mnist

    images = np.random.default_rng(0).random((5, 784), dtype=np.float32)
    labels = np.arange(5, dtype=np.int64)
    good = tmp_path / "mnist.pkl.gz"
    with gzip.open(good, "wb") as fh:
        pickle.dump([(images, labels)] * 3, fh, protocol=2)
    data = load_mnist("train", str(good))
    assert len(data) == 5
    odd = tmp_path / "odd.pkl.gz"
    with gzip.open(odd, "wb") as fh:
        pickle.dump({"a": 1}, fh)
    with pytest.raises(safe_pickle.UnsafePickleError, match="does not hold"):
        load_mnist("train", str(odd))
