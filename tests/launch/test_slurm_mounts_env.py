"""A rendered Slurm job means what the user typed (issue 25 point 6, issue 24 point 6):

* container mount lists cannot be split by a value: a ``,`` or ``:`` in a mounted path (which
  Apptainer's --bind and Pyxis' --container-mounts cannot escape) is refused, exit 2, naming it;
* ``--env`` cannot replace the script's own variables (MAX_REQUEUES, RUN_DIR, ...) nor Slurm's
  (SLURM_RESTART_COUNT): refused, exit 2; every variable a rendered script assigns is covered;
* ``hpctrain slurm [options] SCRIPT.py ARGS`` takes the script's own options as ``hpctrain run`` does;
* without --cpus-per-task a warning, and OMP_NUM_THREADS from the CPUs the job got.
"""

from __future__ import annotations

import re
import shlex
import subprocess

import pytest

from hpctrain.cli import main
from hpctrain.launch.slurm import SlurmOptions, render, sbatch_job

TIME = ["--nodes", "1", "--time", "10"]
CONFIG = ["data.name=synthetic_tiny", "run.dir=runs/x"]
RUNTIMES = {"apptainer": ("/images/t.sif", "--bind"), "pyxis": ("nvcr.io#nvidia/pytorch:24.05-py3",
                                                                "--container-mounts")}


def _slurm(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["slurm", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _container(runtime: str) -> list[str]:
    return ["--container", RUNTIMES[runtime][0], "--container-runtime", runtime]


def _mounts(script: str, runtime: str) -> list[str]:
    """The host paths of the rendered mount list, split as the runtime splits it."""
    option = RUNTIMES[runtime][1]
    found = re.search(rf"{option}[= ](\S+)", script)
    assert found, script
    value = shlex.split(found.group(1))[0]
    return [item.split(":")[0] for item in value.split(",")]


@pytest.mark.parametrize("runtime", sorted(RUNTIMES))
@pytest.mark.parametrize("argv, culprit", [
    (["data.path=/data/x,/root/.ssh:/data/x"], "data.path '/data/x,/root/.ssh:/data/x' holds ',' and ':'"),
    (["--mount", "/scratch/a,/etc"], "--mount /scratch/a,/etc '/scratch/a,/etc' holds ','"),
    (["--mount", "/scratch/a:/etc"], "holds ':'"),
    (["run.dir=runs/a:b"], "run.dir "),
])
def test_a_mount_path_the_runtime_would_split_is_refused(runtime, argv, culprit, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, out, err = _slurm(capsys, *CONFIG, *argv, *TIME, *_container(runtime), "--dry-run")
    assert code == 2 and out == "", err
    assert culprit in err and RUNTIMES[runtime][1] in err and "hint:" in err and "Traceback" not in err


@pytest.mark.parametrize("runtime", sorted(RUNTIMES))
def test_mount_lists_hold_exactly_the_paths_given(runtime, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, out, err = _slurm(capsys, *CONFIG, "data.path=/scratch/d/train-{000,001}.tar", *TIME,
                            *_container(runtime), "--mount", "/opt/extra", "--cpus-per-task", "2", "--dry-run")
    assert code == 0, err
    # a brace pattern's commas stay out of the list: its directory is mounted (run.dir is inside the workdir)
    assert _mounts(out, runtime) == [str(tmp_path), "/scratch/d", "/opt/extra"]


@pytest.mark.parametrize("item, culprit", [
    ("MAX_REQUEUES=99", "would replace the job script's own MAX_REQUEUES; hint: set it with --max-requeues"),
    ("RUN_DIR=/tmp/elsewhere", "own RUN_DIR; hint: set it with run.dir="),
    ("RDZV_PORT=1", "hint: set it with --rdzv-port"),
    ("HPCTRAIN_SIGNALS=SIGUSR2", "hint: set it with --signal"),
    ("step=1", "own step"),
    ("SLURM_RESTART_COUNT=0", "SLURM_RESTART_COUNT=... is refused: Slurm sets it for the job"),
    ("SLURM_JOB_ID=1", "Slurm sets it"),
    ("IFS=x", "it changes how bash runs the script"),
    ("BASH_ENV=/tmp/x", "it changes how bash runs the script"),
])
def test_env_cannot_replace_the_scripts_own_variables(item, culprit, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, out, err = _slurm(capsys, *CONFIG, *TIME, "--env", item, "--dry-run")
    assert code == 2 and out == "" and culprit in err and "Traceback" not in err, err


def _assigned(script: str) -> set[str]:
    """Every variable name a script assigns (NAME=..., export NAME=..., after ; or a blank)."""
    names = set()
    for line in script.splitlines():
        if line.lstrip().startswith("#"):
            continue
        names |= set(re.findall(r"(?:^|[;\s])(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=", line))
    return names


def test_every_variable_a_rendered_script_assigns_is_refused_as_env(tmp_path, monkeypatch, capsys):
    """Whatever the script sets, --env cannot replace: the user's own --env names and the passed
    NCCL_*/GLOO_* aside, OMP_NUM_THREADS is the one default an --env of the user's may set."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('hi')\n")
    scripts = [render(sbatch_job(SlurmOptions(nodes=2, time="10", gpus_per_node=4, container="/i.sif",
                                            container_runtime="apptainer", env=("MY_X=1",)), CONFIG,
                               environ={"NCCL_DEBUG": "WARN"}, workdir=tmp_path)),
               render(sbatch_job(SlurmOptions(nodes=1, time="10", cpus_per_task=4, signal="HUP"), ["train.py", "-x"],
                               environ={}, workdir=tmp_path))]
    names = set().union(*map(_assigned, scripts)) - {"MY_X", "NCCL_DEBUG", "OMP_NUM_THREADS"}
    assert {"RUN_DIR", "MAX_REQUEUES", "RDZV_PORT", "HPCTRAIN_SIGNALS", "restarts"} <= names
    for name in sorted(names):
        assert _slurm(capsys, *CONFIG, *TIME, "--env", f"{name}=1", "--dry-run")[0] == 2, name


def test_an_env_omp_num_threads_of_the_users_is_the_only_one(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, out, err = _slurm(capsys, *CONFIG, *TIME, "--cpus-per-task", "8", "--mem", "8G", "--env", "OMP_NUM_THREADS=3",
                            "--dry-run")
    assert code == 0 and [line for line in out.splitlines() if "OMP_NUM_THREADS" in line] == \
        ["export OMP_NUM_THREADS=3"]
    assert "warning" not in err


def test_a_script_and_its_own_options_follow_the_slurm_options(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('hi')\n")
    for argv in (["--dry-run", "train.py", "--epochs", "2", "--nodes", "9"],
                 ["--python", "python3", "--dry-run", "train.py", "--epochs", "2", "--nodes", "9"],
                 ["--dry-run", "--", "train.py", "--epochs", "2", "--nodes", "9"],
                 ["--dry-run", "python", "train.py", "--epochs", "2", "--nodes", "9"]):
        code, out, err = _slurm(capsys, *TIME, "--cpus-per-task", "1", *argv)
        assert code == 0, (argv, err)
        # the words after the script are the script's (its own --nodes 9 too), not hpctrain slurm's
        assert f"{tmp_path / 'train.py'} --epochs 2 --nodes 9 &" in out and "#SBATCH --nodes=1" in out, argv


def test_without_cpus_per_task_a_warning_and_threads_from_the_cpus_the_job_got(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, out, err = _slurm(capsys, *CONFIG, *TIME, "--nproc-per-node", "2", "--dry-run")
    assert code == 0 and "warning: no --cpus-per-task" in err and "hint: --cpus-per-task" in err
    lines = "\n".join(line for line in out.splitlines() if "OMP_NUM_THREADS" in line)
    for cpus, threads in (("8", "4"), ("1", "1"), (None, "1")):
        env = {"PATH": "/usr/bin:/bin", **({"SLURM_CPUS_ON_NODE": cpus} if cpus else {})}
        got = subprocess.run(["bash", "-c", f"set -u\n{lines}\necho $OMP_NUM_THREADS"], env=env,
                             capture_output=True, text=True, check=True).stdout.strip()
        assert got == threads, (cpus, got)
    code, out, err = _slurm(capsys, *CONFIG, *TIME, "--nproc-per-node", "2", "--cpus-per-task", "6", "--mem", "0",
                            "--dry-run")
    assert code == 0 and "warning" not in err and "export OMP_NUM_THREADS=3  # CPUs per rank" in out
