"""A user's files are never touched (issue 25, point 3): hpctrain writes only into a folder it
created, an empty one, or one holding its run marker; run.overwrite=true removes only what
hpctrain wrote; system roots and the home folder are refused; ``~`` and ``$VAR`` are expanded.
A disk full at start is exit 1 (point 8, as docs/checkpointing.md says)."""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from hpctrain.checkpoint import layout
from hpctrain.config import load_config
from hpctrain.core.rundir import MARKER, RunDirError, check_run_dir, resolve_run_dir
from tests import test_bad_inputs
from tests.test_bad_inputs import Outcome

hpctrain_in_process = test_bad_inputs.hpctrain_in_process  # the fixture: `hpctrain ARGV` in this process
Run = Callable[[list[str], Path], Outcome]
TINY = ["model.name=tests.ckpt_models:tiny_mlp", "data.name=synthetic_tiny", "data.synthetic_size=64",
        "data.batch_size=16", "data.max_val_samples=16", "train.progress=false", "checkpoint.every_steps=2",
        "checkpoint.every_seconds=None", "train.threads=1", "train.epochs=3", "train.log_every=1"]


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every path under root with its bytes (None for a folder)."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def _error_line(result: Outcome, code: int) -> str:
    assert result.returncode == code, result.stderr
    assert "Traceback" not in result.stderr and "internal error" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if ": error: " in line]
    assert len(errors) == 1, result.stderr
    return errors[0]


@pytest.fixture
def lightning_dir(tmp_path: Path) -> Path:
    """Another tool's run: names hpctrain uses too, contents that are not hpctrain's."""
    run = tmp_path / "lightning"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("trainer:\n  max_epochs: 3\nmodel:\n  lr: 0.1\n")
    (run / "model.pt").write_bytes(b"weights")
    (run / "status.json").write_text('{"state": "done"}')
    (run / "metrics.jsonl").write_text('{"loss": 1}\n')
    (run / "checkpoints" / "best.json").write_text('{"epoch": 3}')
    return run


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished hpctrain run: 4 steps, checkpoints at 2 and 4."""
    from hpctrain.train import train

    run = tmp_path_factory.mktemp("rundir") / "finished"
    train(load_config(None, [*TINY, "train.max_steps=4", f"run.dir={run}"]))
    return run


@pytest.mark.parametrize("extra", [[], ["run.overwrite=true", "resume=never"], ["run.overwrite=true"]])
def test_foreign_folder_is_refused_and_left_as_it_was(lightning_dir: Path, tmp_path: Path, extra: list[str],
                                                      hpctrain_in_process: Run) -> None:
    before = _tree(lightning_dir)
    result = hpctrain_in_process(["train", *TINY, "train.max_steps=2", f"run.dir={lightning_dir}", *extra], tmp_path)
    line = _error_line(result, 2)
    assert "already holds files hpctrain did not write (checkpoints/, config.yaml, metrics.jsonl, model.pt, " \
           "status.json)" in line, line
    assert f"hint: name a subfolder, e.g. run.dir={lightning_dir / 'run1'}" in line
    assert _tree(lightning_dir) == before


def test_a_subfolder_of_a_foreign_folder_is_fine(lightning_dir: Path, tmp_path: Path,
                                                 hpctrain_in_process: Run) -> None:
    before = _tree(lightning_dir)
    result = hpctrain_in_process(["train", *TINY, "train.max_steps=2", f"run.dir={lightning_dir / 'run1'}"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert json.loads((lightning_dir / "run1" / MARKER).read_text())["written_by"] == "hpctrain"
    assert {k: v for k, v in _tree(lightning_dir).items() if not k.startswith("run1")} == before


def test_overwrite_removes_only_what_hpctrain_wrote(finished: Path, tmp_path: Path,
                                                    hpctrain_in_process: Run) -> None:
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    foreign = {"checkpoints/epoch=3-step=1000.ckpt": b"lightning", "notes.txt": b"mine", "plots/loss.png": b"png"}
    for name, data in foreign.items():
        (run / name).parent.mkdir(exist_ok=True)
        (run / name).write_bytes(data)
    old_rows = (run / "metrics.jsonl").read_text().splitlines()
    result = hpctrain_in_process(["train", *TINY, "train.max_steps=2", "run.overwrite=true", "resume=never",
                                  f"run.dir={run}"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert {name: (run / name).read_bytes() for name in foreign} == foreign  # kept, byte for byte
    assert [s for s, _ in layout.committed(run / "checkpoints")] == [2]  # only the new run's
    assert json.loads((run / "summary.json").read_text())["steps"] == 2
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in rows) == 2 and len(rows) < len(old_rows)  # the old run's rows are gone


def test_run_dir_of_an_older_hpctrain_still_resumes(finished: Path, tmp_path: Path) -> None:
    """No marker (an hpctrain before it): recognised by its own config.yaml (hpctrain's sections)
    and status.json (its outcome), continued, and marked."""
    from hpctrain.train import train

    run = tmp_path / "old"
    shutil.copytree(finished, run)
    (run / MARKER).unlink()
    (run / "summary.json").unlink()  # unfinished, as a preempted run of an older version
    assert check_run_dir(run, False, "auto") == "continue"
    summary = train(load_config(None, [*TINY, "train.max_steps=6", f"run.dir={run}"]))
    assert summary["steps"] == 6 and (run / MARKER).is_file()


def test_started_by_hpctrain_slurm_is_its_own(tmp_path: Path) -> None:
    run = tmp_path / "job"
    run.mkdir()
    (run / "hpctrain.sbatch").write_text("# Written by `hpctrain slurm`; `hpctrain slurm status RUN_DIR` ...\n")
    (run / "slurm-12.out").write_text("")
    assert check_run_dir(run, False, "auto") == "start"
    (run / "hpctrain.sbatch").write_text("#!/bin/bash\n# my own job\n")
    with pytest.raises(RunDirError, match="hpctrain did not write"):
        check_run_dir(run, False, "auto")


def test_a_job_hpctrain_slurm_wrote_is_its_own(tmp_path: Path) -> None:
    """The script as `hpctrain slurm` renders it (#SBATCH lines first) marks the folder as
    hpctrain's; and writing it claims the folder, so the job's ranks start there (a 2-node job
    was refused over its own hpctrain.sbatch, slurm-*.out and slurm-jobs.json)."""
    from hpctrain.launch.slurm import JOBS_FILE, write_script

    old = tmp_path / "older"
    old.mkdir()
    shutil.copy(Path(__file__).parent / "golden" / "slurm_plain.sh", old / "hpctrain.sbatch")
    (old / "slurm-7.out").write_text("")
    assert check_run_dir(old, False, "auto") == "start"
    new = tmp_path / "new"
    write_script(type("Plan", (), {"run_dir": new})(), "#!/bin/bash\n#SBATCH --nodes=2\n")
    (new / "slurm-8.out").write_text("")
    (new / JOBS_FILE).write_text("{}")
    assert (new / MARKER).is_file() and check_run_dir(new, False, "auto") == "start"


@pytest.mark.parametrize("where", ["/", "/usr", "/etc", "/bin", "/var", "/tmp", "/home", "~", "/proc/self"])
def test_system_roots_and_home_are_refused(where: str, tmp_path: Path, hpctrain_in_process: Run) -> None:
    result = hpctrain_in_process(["train", *TINY, "train.max_steps=1", f"run.dir={where}"], tmp_path)
    line = _error_line(result, 2)
    assert "is your home folder" in line if where == "~" else "is a system folder" in line, line
    assert "hpctrain writes only into a run directory of its own; hint: name a subfolder" in line
    assert not Path(os.path.expanduser(where), MARKER).exists()


def test_home_and_environment_variables_are_expanded(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    cfg = load_config(None, TINY)
    monkeypatch.setenv("HPCTRAIN_TEST_SCRATCH", str(tmp_path))
    assert resolve_run_dir("~/runs/{model.name}", cfg) == Path.home() / "runs" / "tests.ckpt_models-tiny_mlp"
    assert resolve_run_dir("$HPCTRAIN_TEST_SCRATCH/a", cfg) == tmp_path / "a"
    assert resolve_run_dir("${HPCTRAIN_TEST_SCRATCH}/{data.name}", cfg) == tmp_path / "synthetic_tiny"
    monkeypatch.delenv("HPCTRAIN_TEST_SCRATCH")
    with pytest.raises(RunDirError, match=r"names the environment variable \$HPCTRAIN_TEST_SCRATCH, which is not set"):
        resolve_run_dir("$HPCTRAIN_TEST_SCRATCH/a", cfg)


def test_failed_start_leaves_no_folder_behind(tmp_path: Path, hpctrain_in_process: Run) -> None:
    run = tmp_path / "new" / "run"
    result = hpctrain_in_process(["train", *TINY, "model.name=tests.ckpt_models:no_such_model", f"run.dir={run}"],
                                 tmp_path)
    assert result.returncode == 2, result.stderr
    assert not (tmp_path / "new").exists()  # the marker went with the folders this start made


def test_disk_full_at_start_is_exit_1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      hpctrain_in_process: Run) -> None:
    """docs/checkpointing.md: ENOSPC is a failed run (exit 1: free space, run it again)."""
    run = tmp_path / "run"
    real_open = os.open

    def full(path: object, flags: int, *args: object, **kwargs: object) -> int:
        if str(path).startswith(str(run)) and flags & os.O_CREAT:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real_open(path, flags, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", full)
    result = hpctrain_in_process(["train", *TINY, "train.max_steps=2", f"run.dir={run}"], tmp_path)
    line = _error_line(result, 1)
    assert f"cannot write into run.dir {run}: No space left on device; hint: free space" in line, line
    assert not run.exists()


# ---------------------------------------------------------------- links out of the run directory (issue 42, point 1)


def test_overwrite_never_deletes_or_writes_through_a_checkpoints_link(finished: Path, tmp_path: Path,
                                                                      hpctrain_in_process: Run) -> None:
    """The issue's case: RUN/checkpoints a link to another run's checkpoints; run.overwrite=true
    resume=never used to delete that folder's step-000000001/ and write its own steps there."""
    run, other = tmp_path / "run", tmp_path / "other-run-checkpoints"
    shutil.copytree(finished, run)
    shutil.move(run / "checkpoints", other)
    (run / "checkpoints").symlink_to(other)
    before, outside = _tree(run), _tree(other)
    result = hpctrain_in_process(["train", *TINY, "train.max_steps=2", "run.overwrite=true", "resume=never",
                                  f"run.dir={run}"], tmp_path)
    line = _error_line(result, 2)
    assert f"run.dir {run}: checkpoints is a symbolic link to {other}, outside the run directory; hpctrain never " \
           "writes or deletes through a link out of its run directory" in line, line
    assert f"hint: remove the link ({run / 'checkpoints'})" in line
    assert _tree(other) == outside and _tree(run) == before


@pytest.mark.parametrize("name", ["metrics.jsonl", ".hpctrain.lock", "tensorboard", "checkpoints/step-000000002",
                                  "checkpoints/best.json", "slurm-7.out", "summary.json"])
def test_every_name_hpctrain_writes_is_checked_for_a_link_out(name: str, finished: Path, tmp_path: Path) -> None:
    run, outside = tmp_path / "run", tmp_path / "elsewhere"
    shutil.copytree(finished, run)
    outside.mkdir()
    (outside / "keep.txt").write_text("mine")
    target = run / name
    if target.is_dir():
        shutil.rmtree(target)
    else:
        target.unlink(missing_ok=True)
    target.symlink_to(outside if name in ("tensorboard", "checkpoints/step-000000002") else outside / "keep.txt")
    for overwrite, resume in ((True, "never"), (False, "auto")):
        with pytest.raises(RunDirError, match=f": {name} is a symbolic link to {outside}"):
            check_run_dir(run, overwrite, resume)
    assert (outside / "keep.txt").read_text() == "mine"


def test_a_link_that_stays_inside_the_run_directory_is_followed(finished: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    os.replace(run / "checkpoints", run / "checkpoints.real")
    (run / "checkpoints").symlink_to("checkpoints.real")
    (run / "summary.json").unlink()
    assert check_run_dir(run, False, "auto") == "continue"


def test_the_lock_is_never_taken_through_a_link(tmp_path: Path) -> None:
    """Taking the lock truncates and rewrites its file: never the one a link points to, even one
    made after the run directory was checked."""
    from hpctrain.core.run_lock import RunDirLinkError, RunDirLock

    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / ".hpctrain.lock").symlink_to(victim)
    with pytest.raises(RunDirLinkError, match=r"\.hpctrain\.lock is a symbolic link to .*victim\.txt"):
        RunDirLock(tmp_path / "run").acquire()
    assert victim.read_text() == "precious"


# ---------------------------------------------------------------- a dropped bound (issue 38, point 4)


def test_dropping_max_steps_continues_a_finished_run_like_a_larger_bound(finished: Path, tmp_path: Path) -> None:
    """The finished run stopped at train.max_steps=4 of its 3 epochs (12 steps): the same command
    without train.max_steps continues to the epochs' end, exactly as train.max_steps=12 does."""
    from hpctrain.train import train

    dropped, raised = tmp_path / "dropped", tmp_path / "raised"
    shutil.copytree(finished, dropped)
    shutil.copytree(finished, raised)
    assert check_run_dir(dropped, False, "auto", load_config(None, TINY).train) == "extend"
    without = train(load_config(None, [*TINY, f"run.dir={dropped}"]))
    larger = train(load_config(None, [*TINY, "train.max_steps=12", f"run.dir={raised}"]))
    assert without["steps"] == larger["steps"] == 12
    assert without["params_sha256"] == larger["params_sha256"]
    # now every epoch is done: the same command has nothing left to train
    with pytest.raises(RunDirError, match="already holds a finished run .*nothing to resume"):
        check_run_dir(dropped, False, "auto", load_config(None, TINY).train)
