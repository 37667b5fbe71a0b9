"""Plain I/O errors are product behaviour, not bugs (issue 17, point 6).

A full disk, a read-only or unreadable run directory, an unwritable shard directory: each
ends in one line naming the path, with exit 1 (the run failed: free space and run it again)
or 2 (the path is wrong: choose another), no traceback, and a hint that never suggests
deleting what could not be read. A run that fails after it started leaves ``status.json``
saying ``failed`` and why.

The tests run as root, for whom ``chmod`` blocks nothing, and mounting a read-only file
system needs privileges CI may lack: a read-only or forbidden path is simulated with an
``OSError`` raised where the real one would be (``os.open`` for writes, ``Path.iterdir`` for
listing), a full disk with ``/dev/full`` (every write fails with ENOSPC), and a path that
cannot be a directory with a file standing in its place. Everything runs in this process
through the CLI's entry point (tests/test_bad_inputs.py's fixture), except the start from
the directory above a checkout, which needs an interpreter of its own.
"""

from __future__ import annotations

import ast
import contextlib
import errno
import io
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from hpctrain import cli
from hpctrain.core.atomic import atomic_write_text
from hpctrain.core.errors import IO_ERRNOS, io_message
from hpctrain.core.rundir import claim_run_dir
from tests import test_bad_inputs
from tests.test_bad_inputs import REPO, TINY, Outcome, _as_a_fresh_process, _main, _tree

Run = Callable[[list[str], Path], Outcome]
hpctrain_in_process = test_bad_inputs.hpctrain_in_process  # the fixture: `hpctrain ARGV` in this process
DEV_FULL = Path("/dev/full")
needs_dev_full = pytest.mark.skipif(not DEV_FULL.exists(), reason="no /dev/full on this system")


def _oserror(code: int, path: object) -> OSError:
    return OSError(code, os.strerror(code), str(path))


def _one_line_error(result: Outcome, code: int, *fragments: str) -> None:
    """Exit ``code``, no traceback, one error line holding every fragment, no hint to delete."""
    assert result.returncode == code, result.stderr
    assert "Traceback" not in result.stderr and "internal error" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if ": error: " in line]
    assert len(errors) == 1, result.stderr
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    for word in ("delete", "remove", "overwrite", "corrupt"):
        assert word not in errors[0], errors[0]


def _status(run: Path) -> dict:
    return json.loads((run / "status.json").read_text())


@pytest.fixture(scope="module")
def unfinished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run with two committed checkpoints and no summary.json: what resume=auto continues."""
    run = tmp_path_factory.mktemp("io-errors") / "run"
    with pytest.MonkeyPatch.context() as mp, _as_a_fresh_process(), contextlib.redirect_stderr(io.StringIO()), \
            contextlib.redirect_stdout(io.StringIO()):
        mp.setenv("OMP_NUM_THREADS", "1")
        code = _main(["train", *TINY, "train.max_steps=4", "data.batch_size=8", "checkpoint.every_steps=2",
                      f"run.dir={run}"])
    assert code == 0
    (run / "summary.json").unlink()
    return run


# ---------------------------------------------------------------- training


@needs_dev_full
def test_disk_full_while_metrics_jsonl_is_written(tmp_path: Path, hpctrain_in_process: Run,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from hpctrain.telemetry import loggers

    run = tmp_path / "run"
    run.mkdir()
    claim_run_dir(run)  # an hpctrain run dir (a folder holding foreign files is refused before any write)

    def full_metrics(path: object, *args: object, **kwargs: object) -> object:
        # every row's write fails with ENOSPC (a symlink to /dev/full is refused now: a link out of the run dir)
        target = DEV_FULL if str(path).endswith("metrics.jsonl") else path
        return open(target, *args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(loggers, "open", full_metrics, raising=False)
    result = hpctrain_in_process(["train", *TINY, "train.max_steps=2", "train.log_every=1", "data.batch_size=8",
                                  f"run.dir={run}"], tmp_path)
    _one_line_error(result, 1, f"cannot append a row to {run / 'metrics.jsonl'}: No space left on device",
                    "hint: free space")
    status = _status(run)
    assert status["outcome"] == "failed" and "metrics.jsonl" in status["error"]


def test_read_only_run_dir_on_resume(unfinished_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     hpctrain_in_process: Run) -> None:
    run = tmp_path / "run"
    shutil.copytree(unfinished_run, run)
    real_open = os.open

    def read_only(path: object, flags: int, *args: object, **kwargs: object) -> int:
        if str(path).startswith(str(run)) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise _oserror(errno.EROFS, path)  # what a read-only mount answers, root or not
        return real_open(path, flags, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", read_only)
    before = _tree(run)
    result = hpctrain_in_process(["train", *TINY, "train.max_steps=6", "data.batch_size=8",
                                  "checkpoint.every_steps=2", f"run.dir={run}"], tmp_path)
    _one_line_error(result, 2, f"cannot write into run.dir {run}: Read-only file system", "hint:")
    assert _tree(run) == before


def test_unreadable_checkpoints_dir_is_not_called_corrupt(unfinished_run: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          hpctrain_in_process: Run) -> None:
    run = tmp_path / "run"
    shutil.copytree(unfinished_run, run)
    real_iterdir = Path.iterdir

    def forbidden(self: Path):  # type: ignore[no-untyped-def]
        if self == run / "checkpoints":
            raise _oserror(errno.EACCES, self)  # chmod 000 as another user; root ignores modes
        return real_iterdir(self)

    monkeypatch.setattr(Path, "iterdir", forbidden)
    before = _tree(run)
    result = hpctrain_in_process(["train", *TINY, "train.max_steps=6", "data.batch_size=8", f"run.dir={run}"],
                                 tmp_path)
    _one_line_error(result, 2, f"cannot list {run / 'checkpoints'}: Permission denied", "hint: check the permissions")
    assert _tree(run) == before  # nothing set aside, nothing replaced


def test_model_pt_that_cannot_be_written_leaves_status_failed(tmp_path: Path, hpctrain_in_process: Run) -> None:
    run = tmp_path / "run"
    run.mkdir()
    claim_run_dir(run)  # an hpctrain run dir (a folder holding foreign files is refused before any write)
    (run / "model.pt").mkdir()  # a folder where the weights go: every write of model.pt fails
    result = hpctrain_in_process(["train", *TINY, "train.max_steps=2", "data.batch_size=8",
                                  "checkpoint.enabled=false", f"run.dir={run}"], tmp_path)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert f"cannot write {run / 'model.pt'}" in result.stderr
    status = _status(run)
    assert status["outcome"] == "failed" and status["step"] == 2 and "model.pt" in status["error"], status
    assert not (run / "summary.json").exists()


# ---------------------------------------------------------------- hpctrain data shard


@pytest.fixture
def npz_source(tmp_path: Path) -> str:
    path = tmp_path / "d.npz"
    np.savez(path, x=np.ones((12, 4), np.float32), y=np.arange(12) % 3)
    return f"npz:{path}"


def test_shard_into_a_path_under_a_file(tmp_path: Path, npz_source: str, hpctrain_in_process: Run) -> None:
    out = tmp_path / "d.npz" / "out"
    result = hpctrain_in_process(["data", "shard", npz_source, str(out), "--split", "train", "--quiet"], tmp_path)
    _one_line_error(result, 2, f"cannot write shards into {out}: Not a directory")


@pytest.mark.parametrize("fault", ["read-only", "disk-full"])
def test_shard_into_an_unwritable_dir(fault: str, tmp_path: Path, npz_source: str, monkeypatch: pytest.MonkeyPatch,
                                      hpctrain_in_process: Run) -> None:
    from hpctrain.data import writer

    if fault == "disk-full" and not DEV_FULL.exists():
        pytest.skip("no /dev/full on this system")
    out = tmp_path / "out"
    out.mkdir()

    def unwritable(path: object, mode: str = "r", *args: object, **kwargs: object) -> object:
        if fault == "read-only":
            raise _oserror(errno.EROFS, path)
        return open(DEV_FULL, mode, *args, **kwargs)  # type: ignore[call-overload]  # writes fail: ENOSPC

    monkeypatch.setattr(writer, "open", unwritable, raising=False)  # the shard files; module global over builtin
    result = hpctrain_in_process(["data", "shard", npz_source, str(out), "--split", "train", "--quiet"], tmp_path)
    if fault == "read-only":
        _one_line_error(result, 2, f"cannot write shards into {out}", "Read-only file system")
    else:
        _one_line_error(result, 1, f"cannot write shards into {out}: No space left on device", "hint: free space")
    assert list(out.iterdir()) == []  # no temporary shard left behind


# ---------------------------------------------------------------- the CLI's last line of defence


@pytest.mark.parametrize(("code", "exit_code"), [(errno.ENOSPC, 1), (errno.EIO, 1), (errno.EACCES, 2),
                                                 (errno.EROFS, 2)])
def test_an_os_error_no_module_caught_is_one_line(code: int, exit_code: int, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    def fails(args: object) -> int:
        raise _oserror(code, "/runs/x/status.json")

    monkeypatch.setattr(cli, "cmd_models", fails)
    assert cli.main(["models"]) == exit_code
    err = capsys.readouterr().err
    assert err.startswith(f"hpctrain models: error: cannot read or write /runs/x/status.json: {os.strerror(code)}; "
                          "hint: ") and "Traceback" not in err, err


def test_an_os_error_of_another_kind_is_still_a_bug(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    def fails(args: object) -> int:
        raise _oserror(errno.EBADF, "fd")  # a closed descriptor: hpctrain's mistake, not the disk's

    monkeypatch.setattr(cli, "cmd_models", fails)
    assert cli.main(["models"]) == 1
    err = capsys.readouterr().err
    assert "internal error: OSError" in err and "Traceback" in err


def test_io_hints_never_suggest_deleting() -> None:
    for code in IO_ERRNOS:
        message = io_message("read", "/data/x", _oserror(code, "/data/x"))
        assert message.startswith(f"cannot read /data/x: {os.strerror(code)}; hint: "), message
        for word in ("delete", "remove", "rm ", "overwrite"):
            assert word not in message, message


def test_atomic_write_names_the_file_a_failed_fsync_was_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # write(2) and fsync(2) name no file

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError) as caught:
        atomic_write_text(tmp_path / "status.json", "{}")
    assert caught.value.filename == str(tmp_path / "status.json")
    assert list(tmp_path.iterdir()) == []  # the temporary file is gone too


# ---------------------------------------------------------------- a start from above the checkout


def test_no_module_needs_the_packages_own_attributes() -> None:
    """The probe's ``ImportError __version__`` at every checkpoint commit: started beside a
    checkout named hpctrain (with setuptools' editable finder, consulted after the path finder),
    ``hpctrain`` is a namespace package whose ``__init__`` never runs, so no module may import a
    name from the package itself (``from hpctrain import __version__`` did); submodules are found
    either way. Checked on the source, in milliseconds, instead of a training run from there."""
    package = REPO / "hpctrain"
    offending = []
    for path in package.rglob("*.py"):
        if path == package / "__init__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "hpctrain" and node.level == 0:
                offending += [f"{path.relative_to(REPO)}: from hpctrain import {a.name}" for a in node.names
                              if not ((package / f"{a.name}.py").is_file() or (package / a.name).is_dir())]
    assert not offending, offending
