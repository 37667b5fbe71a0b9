"""No value can change what the generated sbatch script does (issue 17, point 0).

The exploit of the issue: a run.dir holding newlines put `touch pwned` on a line of its own
in the script. Values that sbatch reads unquoted (the paths of #SBATCH lines) and the names of
exported variables are refused before anything is written (exit 2, naming the value); every
other value is shell-quoted, which bash itself confirms below.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from hpctrain.cli import main
from hpctrain.launch.slurm import SlurmOptions, render, sbatch_job

TIME = ["--nodes", "1", "--time", "10"]


@pytest.mark.parametrize("run_dir", ["runs/x\ntouch pwned\n/b", "runs/with space", "runs/it's", "runs/%j",
                                     "runs/$(touch pwned)"])
def test_run_dirs_sbatch_cannot_take_are_refused_before_anything_is_written(
        run_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    for mode in ("--dry-run", "--submit"):  # refused before sbatch would ever be called
        assert main(["slurm", "data.name=synthetic_tiny", f"run.dir={run_dir}", *TIME, mode]) == 2
        err = capsys.readouterr().err
        assert "cannot go into an #SBATCH line" in err and "hint:" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []  # no script, no run directory, no pwned


def test_an_environment_variable_name_that_is_code_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("NCCL_X$(touch pwned)", "1")  # NCCL_* variables are passed through to the job
    assert main(["slurm", "data.name=synthetic_tiny", "run.dir=runs/x", *TIME, "--dry-run"]) == 2
    assert "is not a shell name" in capsys.readouterr().err
    assert not (tmp_path / "pwned").exists()


def test_other_values_reach_the_job_as_they_were_written(tmp_path: Path) -> None:
    """Newlines, quotes, `$( )`, backticks and `;` in a config value, an --env value and the
    setup-free parts of the script: bash parses the rendered step into exactly the words given."""
    odd = "a'b\"c\n$(touch pwned);`touch pwned`"
    opts = SlurmOptions(nodes=1, time="10", env=[f"MY_VAR={odd}"])
    plan = sbatch_job(opts, ["data.name=synthetic_tiny", f"data.path={odd}", f"run.dir={tmp_path / 'run'}"],
                    environ={}, workdir=tmp_path)
    script = render(plan)
    # run the script's exports and step with srun replaced by a printer of its arguments
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "srun").write_text('#!/bin/bash\nprintf "%s\\0" "$@" > "$ARGS_OUT"\n')
    (stub / "srun").chmod(0o755)
    (stub / "scontrol").write_text("#!/bin/bash\necho node1\n")
    (stub / "scontrol").chmod(0o755)
    env = {**os.environ, "PATH": f"{stub}:{os.environ['PATH']}", "ARGS_OUT": str(tmp_path / "args"),
           "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node1"}
    body = script.split("\nstep=$!", 1)[0] + '\nwait $!\nprintf "%s" "$MY_VAR" > "$ARGS_OUT.env"\n'
    subprocess.run(["bash", "-c", body], cwd=tmp_path, env=env, check=True, timeout=60)
    words = (tmp_path / "args").read_bytes().decode().split("\0")
    assert f"data.path={odd}" in words
    assert (tmp_path / "args.env").read_text() == odd
    assert not (tmp_path / "pwned").exists()
