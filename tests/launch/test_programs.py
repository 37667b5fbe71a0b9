"""A user's own program under hpctrain run / hpctrain slurm (issue 16, point 5): what counts as
one, the job script written for it, and the public "save, then exit 3" helper. The end-to-end
run (`hpctrain run -n 2 python examples/own_loop.py`, SIGUSR1 -> exit 3 -> bit-identical
resume) is tests/test_examples.py."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from hpctrain.checkpoint.preempt import Preemption
from hpctrain.core.errors import EXIT_PREEMPTED, UserError
from hpctrain.core.protocol import OUTCOME_ENV, SIGNALS_ENV, all_preempted, program_signals
from hpctrain.launch.program import user_program
from hpctrain.launch.slurm import SlurmOptions, render, sbatch_job


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return path


def test_what_counts_as_a_users_program(script: Path) -> None:
    assert user_program([str(script), "--lr", "0.1"]) == [str(script), "--lr", "0.1"]
    assert user_program(["python", str(script), "x"]) == [str(script), "x"]
    assert user_program(["python3", "-m", "pkg.train", "--lr", "1"]) == ["-m", "pkg.train", "--lr", "1"]
    assert user_program([], ["pkg.train", "--lr", "1"]) == ["-m", "pkg.train", "--lr", "1"]
    assert user_program(["train", "job.yaml"]) is None and user_program([]) is None
    with pytest.raises(UserError, match="missing.py does not exist"):
        user_program(["missing.py"])
    with pytest.raises(UserError, match="-m needs a module"):
        user_program([], [])


def test_the_job_script_runs_the_program_with_the_chosen_signal(script: Path, tmp_path: Path) -> None:
    opts = SlurmOptions(nodes=2, time="01:00:00", signal="HUP", run_dir="runs/mine")
    plan = sbatch_job(opts, ["python", script.name, "--epochs", "3"], environ={}, workdir=tmp_path)
    text = render(plan)
    assert plan.run_dir == tmp_path / "runs" / "mine" and plan.program == (str(script), "--epochs", "3")
    assert f"export {SIGNALS_ENV}=SIGHUP,SIGTERM" in text
    assert "#SBATCH --signal=B:HUP@" in text
    assert "trap 'forward HUP; scancel --signal=HUP \"$SLURM_JOB_ID\"' HUP" in text
    step = text[text.index("srun "):text.index(" &\n")]
    assert '--run-dir="$RUN_DIR"' in step and step.endswith(f"{script} --epochs 3") and " train " not in step
    path = tmp_path / "job.sh"
    path.write_text(text)
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0


def test_a_module_gets_a_run_directory_named_after_it(tmp_path: Path) -> None:
    plan = sbatch_job(SlurmOptions(nodes=1, time="10:00"), ["python", "-m", "pkg.train"], environ={}, workdir=tmp_path)
    assert plan.run_dir == tmp_path / "runs" / "train" and plan.program == ("-m", "pkg.train")


def test_preemption_helper_saves_then_exits_3_and_tells_the_launcher(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(OUTCOME_ENV, str(tmp_path))
    preemption = Preemption(["SIGUSR2"])
    try:
        assert not preemption.agreed(1)
        os.kill(os.getpid(), signal.SIGUSR2)
        assert preemption.agreed(2)
        with pytest.raises(SystemExit) as ended:
            preemption.exit()
    finally:
        preemption.flag.uninstall()
    assert ended.value.code == EXIT_PREEMPTED and (tmp_path / "rank-0").read_text() == "preempted"
    assert not all_preempted(tmp_path, 2) and all_preempted(tmp_path, 1)


def test_the_programs_signals_follow_hpctrain_slurm() -> None:
    assert program_signals(["SIGUSR1", "SIGTERM"], {SIGNALS_ENV: "SIGHUP,SIGTERM"}) == ["SIGHUP", "SIGTERM"]
    assert program_signals(["SIGUSR1", "SIGTERM"], {}) == ["SIGUSR1", "SIGTERM"]
