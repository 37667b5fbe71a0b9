"""``hpctrain slurm``: rendered scripts against golden files (plain, Apptainer, Pyxis, multi-node),
``bash -n`` on each, the batch shell's trap/requeue rule run by bash itself, and the option
checks that must fail before anything is written (issue 9, section 1).

Regenerate the golden files after an intended change:
``HPCTRAIN_UPDATE_GOLDEN=1 pytest tests/launch/test_slurm_render.py``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from hpctrain.cli import main
from hpctrain.launch import slurm
from hpctrain.launch.slurm import SlurmOptions, render, sbatch_job

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
WORKDIR = Path("/work/project")  # never created: rendering only resolves paths
ENVIRON = {"NCCL_DEBUG": "WARN", "NCCL_SOCKET_IFNAME": "ib0", "GLOO_SOCKET_IFNAME": "ib0", "HOME": "/home/u"}
CONFIG = ["data.name=synthetic_tiny", "model.name=mnist_cnn", "run.dir=runs/golden"]

CASES = {
    "plain": SlurmOptions(nodes=1, time="00:30:00", nproc_per_node=2, cpus_per_task=4, python="/opt/venv/bin/python",
                          max_requeues=2),
    "multinode": SlurmOptions(nodes=4, time="2-00:00:00", gpus_per_node=8, cpus_per_task=64, mem="480G",
                              partition="gpu", account="proj42", qos="high", python="python",
                              setup="module load cuda/12.4; source /opt/venv/bin/activate", signal_lead_s=600),
    "apptainer": SlurmOptions(nodes=2, time="04:00:00", gres="gpu:a100:4", cpus_per_task=32,
                              container="/images/pytorch.sif", container_runtime="apptainer",
                              mounts=("/scratch/datasets",)),
    "pyxis": SlurmOptions(nodes=2, time="04:00:00", gpus_per_node=4, container="nvcr.io#nvidia/pytorch:24.05-py3",
                          container_runtime="pyxis", env=("TORCH_NCCL_ASYNC_ERROR_HANDLING=1",)),
}


def _render(name: str) -> str:
    extra = ["data.path=/scratch/datasets/mnist-shards"] if name == "apptainer" else []
    return render(sbatch_job(CASES[name], [*CONFIG, *extra], environ=ENVIRON, workdir=WORKDIR))


@pytest.mark.parametrize("name", sorted(CASES))
def test_rendered_script_matches_golden_and_parses(name: str, tmp_path: Path) -> None:
    text = _render(name)
    golden = GOLDEN / f"slurm_{name}.sh"
    if os.environ.get("HPCTRAIN_UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text(), f"{golden} differs; HPCTRAIN_UPDATE_GOLDEN=1 regenerates it"
    script = tmp_path / "job.sh"
    script.write_text(text)
    check = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr


def test_scripts_carry_the_requeue_contract() -> None:
    for name in CASES:
        text = _render(name)
        head = [line for line in text.splitlines() if line.startswith("#SBATCH")]
        for want in ("--requeue", "--open-mode=append", "--ntasks-per-node=1", "--output=/work/project/runs/golden/"
                     "slurm-%j.out", "--error=/work/project/runs/golden/slurm-%j.err"):
            assert any(want in line for line in head), (name, want)
        assert any(line.startswith("#SBATCH --signal=B:USR1@") for line in head), name
        # scontrol only ever runs in the batch shell, on the host, never inside the container
        step = text[text.index("srun "):text.index("step=$!")]
        assert "scontrol" not in step and "scontrol requeue" in text


def test_multinode_numbers() -> None:
    text = _render("multinode")
    assert "#SBATCH --nodes=4" in text and "#SBATCH --gpus-per-node=8" in text
    assert "--nnodes=4 --nproc=8" in text and "export OMP_NUM_THREADS=8" in text  # 64 CPUs / 8 ranks
    assert "#SBATCH --signal=B:USR1@600" in text and "--shutdown-timeout=600" in text
    assert "export NCCL_SOCKET_IFNAME=ib0" in text and "export GLOO_SOCKET_IFNAME=ib0" in text and "HOME" not in text


# ---------------------------------------------------------------- the batch shell's logic, run by bash


FAKE_SRUN = """#!/bin/bash
# a job step: trains until a preemption signal (then "saves" and exits 3) or exits with $STEP_EXIT by itself
# (as hpctrain's ranks do, the step records the preemption in the run's status.json before it exits 3)
for sig in USR1 USR2 HUP TERM; do
  trap "echo step-got-$sig >> $LOG; mkdir -p ${STATUS%/*}; echo '{\"outcome\": \"preempted\"}' > $STATUS; exit 3" $sig
done
echo $$ > "$LOG.step"
echo "srun $*" >> "$LOG"
if [ -n "${STEP_EXIT:-}" ]; then  # STEP_SAVED: the ranks saved and said so first (then srun killed them)
  [ -n "${STEP_SAVED:-}" ] && mkdir -p "${STATUS%/*}" && echo '{"outcome": "preempted"}' > "$STATUS"
  exit "$STEP_EXIT"
fi
for _ in $(seq 200); do sleep 0.05; done
exit 0
"""
FAKE_SCONTROL = """#!/bin/bash
if [ "$1" = show ]; then echo node7; echo node8; else echo "scontrol $*" >> "$LOG"; fi
"""
# scancel --signal=SIG JOBID: Slurm signals the job's steps (here: the fake srun's process)
FAKE_SCANCEL = """#!/bin/bash
echo "scancel $*" >> "$LOG"
kill "-${1#--signal=}" "$(cat "$LOG.step")"
"""


def _default_signals() -> None:
    """As slurmd starts a batch shell: a signal ignored on entry (nohup ignores HUP; so would a
    test runner started under it) cannot be trapped by a non-interactive bash."""
    for name in ("SIGUSR1", "SIGUSR2", "SIGHUP", "SIGTERM"):
        signal.signal(getattr(signal, name), signal.SIG_DFL)


def _run_script(tmp_path: Path, *, restarts: int = 0, step_exit: str = "", signal_after: float | None = None,
                max_requeues: int = 2, sig: str = "USR1", saved: bool = False, send: str | None = None
                ) -> tuple[int, str]:
    """Run the script of a job with --signal SIG under bash with fake Slurm commands; SEND (default
    SIG) is sent to the batch shell SIGNAL_AFTER seconds after the step started."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL), ("scancel", FAKE_SCANCEL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    opts = SlurmOptions(nodes=2, time="01:00:00", python="python", max_requeues=max_requeues, signal=sig)
    script = tmp_path / "job.sh"
    script.write_text(render(sbatch_job(opts, [f"run.dir={tmp_path / 'run'}"], environ={}, workdir=tmp_path)))
    log = tmp_path / "log"
    log.write_text("")
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "LOG": str(log), "STATUS": str(tmp_path / "run" / "status.json"),
           "SLURM_JOB_ID": "4242",
           "SLURM_JOB_NODELIST": "node[7-8]", "SLURM_RESTART_COUNT": str(restarts), "STEP_EXIT": step_exit,
           "STEP_SAVED": "1" if saved else ""}
    proc = subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            preexec_fn=_default_signals)
    if signal_after is not None:
        deadline = time.monotonic() + 10
        while "srun" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(signal_after)
        for _ in range(2):  # B:SIG reaches the batch shell only; a second one (a repeated warning) changes nothing
            proc.send_signal(getattr(signal, f"SIG{send or sig}"))
            time.sleep(0.1)
    out, _ = proc.communicate(timeout=30)
    return proc.returncode, out.decode() + log.read_text()


@pytest.mark.parametrize("sig", slurm.SIGNALS)
def test_the_signal_to_the_batch_shell_is_forwarded_and_requeues(tmp_path: Path, sig: str) -> None:
    code, out = _run_script(tmp_path, signal_after=0.2, sig=sig)
    assert code == 3, out
    assert f"step-got-{sig}" in out and out.count("scontrol requeue 4242") == 1, out
    # srun would answer HUP/TERM with SIGKILL to every task: those reach the step through scancel
    assert (f"scancel --signal={sig} 4242" in out) == (sig in ("HUP", "TERM")), out
    assert "--rdzv-endpoint=node7:" in out.replace('"', "") or "rdzv-endpoint=node7" in out, out


def test_term_to_the_batch_shell_of_a_usr1_job_is_forwarded_and_requeues(tmp_path: Path) -> None:
    """A preemption with a grace time (and an admin's scancel) sends TERM to every process of the
    job: the batch shell traps it besides --signal's SIG, hands it to the step through scancel
    (srun would SIGKILL the tasks) and requeues after the ranks' exit 3."""
    code, out = _run_script(tmp_path, signal_after=0.2, sig="USR1", send="TERM")
    assert code == 3, out
    assert "hpctrain: TERM at " in out and "step-got-TERM" in out and "scancel --signal=TERM 4242" in out, out
    assert out.count("scontrol requeue 4242") == 1, out


def test_no_requeue_after_k_restarts_nor_on_failure(tmp_path: Path) -> None:
    code, out = _run_script(tmp_path / "k", restarts=2, step_exit="3")
    assert code == 3 and "scontrol requeue" not in out and "not requeued" in out, out
    code, out = _run_script(tmp_path / "fail", step_exit="1")
    assert code == 1 and "scontrol requeue" not in out, out
    code, out = _run_script(tmp_path / "ok", step_exit="0")
    assert code == 0 and "scontrol requeue" not in out, out


def test_a_step_that_saved_but_lost_its_exit_code_is_requeued_with_exit_3(tmp_path: Path) -> None:
    """srun's code for tasks killed after the save (137), or bash's -1 when a second signal hits
    `wait` as the step ends: the run's status.json, written since the job started, says preempted."""
    code, out = _run_script(tmp_path, step_exit="137", saved=True)
    assert code == 3 and "exited with 3 (preempted=1" in out and out.count("scontrol requeue 4242") == 1, out


# ---------------------------------------------------------------- validation: exit 2, numbers, nothing written


@pytest.mark.parametrize(("options", "message"), [
    (["--gpus-per-node", "4", "--gres", "gpu:8"], "--gpus-per-node 4 contradicts --gres gpu:8 (8 GPUs per node)"),
    (["--gpus-per-node", "4", "--nproc-per-node", "2"], "--nproc-per-node 2 differs from --gpus-per-node 4"),
    (["--time", "4h"], "--time '4h' is not a Slurm time"),
    (["--time", "00:05:00", "--signal-lead", "400"], "400 s before the end does not fit in --time 300 s"),
    (["--nproc-per-node", "4", "--cpus-per-task", "2"], "--cpus-per-task 2 is less than the 4 processes per node"),
    (["--container", "x.sif"], "--container and --container-runtime go together"),
    (["--mem", "lots"], "--mem 'lots'"),
    (["--nodes", "0"], "--nodes 0 must be >= 1"),
    (["data.max_train_samples=100", "data.batch_size=16", "--nproc-per-node", "4"],
     "data.max_train_samples (100) is smaller than one global batch: data.batch_size (16) x world_size (8)"),
    (["data.batchsize=3"], "unknown key 'data.batchsize'"),
])
def test_bad_options_fail_before_anything_is_written(options: list[str], message: str, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    config = [o for o in options if "=" in o and not o.startswith("-")]  # positionals come before the options
    flags = [o for o in options if o not in config]
    base = ["slurm", "data.name=synthetic_tiny", f"run.dir={run_dir}", *config, "--nodes", "2", "--time", "01:00:00"]
    assert main([*base, *flags]) == 2
    assert message in capsys.readouterr().err
    assert not run_dir.exists()


def test_missing_nodes_or_time(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["slurm", "data.name=synthetic_tiny"]) == 2
    assert "needs --nodes and --time" in capsys.readouterr().err


def test_time_formats() -> None:
    assert [slurm.parse_time(t) for t in ("30", "30:15", "04:00:00", "1-00", "2-03:04", "1-00:00:01")] == \
        [1800, 1815, 14400, 86400, 183840, 86401]


def test_signal_lead_comes_from_the_measured_save(tmp_path: Path) -> None:
    step = tmp_path / "checkpoints" / "step-000000010"
    step.mkdir(parents=True)
    (step / "manifest.json").write_text(json.dumps({"step": 10, "files": {}, "save_s": 40.2}))
    opts = SlurmOptions(nodes=1, time="02:00:00")
    assert slurm.signal_lead(opts, 7200, tmp_path) == 81 + slurm.SIGNAL_MARGIN_S
    assert slurm.signal_lead(opts, 7200, tmp_path / "nothing") == slurm.DEFAULT_SIGNAL_LEAD_S


def test_write_without_submit_and_dry_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    base = ["slurm", "data.name=synthetic_tiny", f"run.dir={run_dir}", "--nodes", "1", "--time", "10"]
    assert main([*base, "--dry-run"]) == 0
    assert capsys.readouterr().out.startswith("#!/bin/bash\n#SBATCH") and not run_dir.exists()
    assert main(base) == 0
    script = run_dir / slurm.SCRIPT_NAME
    assert script.is_file() and os.access(script, os.X_OK) and f"run.dir={run_dir}" in script.read_text()


# ---------------------------------------------------------------- submit, status, cancel (Slurm's commands stubbed)


FAKE_TOOLS = {
    "sbatch": 'echo "sbatch $*" >> "$LOG"; echo "5151;cluster"',
    "squeue": 'echo RUNNING',
    "scontrol": 'echo "JobId=5151 JobState=RUNNING Restarts=1 NodeList=n[1-2]"',
    "scancel": 'echo "scancel $*" >> "$LOG"',
}


def test_submit_status_cancel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                              capsys: pytest.CaptureFixture[str]) -> None:
    bin_dir, log, run_dir = tmp_path / "bin", tmp_path / "log", tmp_path / "run"
    bin_dir.mkdir()
    for name, body in FAKE_TOOLS.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("LOG", str(log))
    base = ["slurm", "data.name=synthetic_tiny", f"run.dir={run_dir}", "--nodes", "2", "--time", "10"]
    assert main([*base, "--submit"]) == 0
    assert "submitted job 5151" in capsys.readouterr().out
    assert f"sbatch --parsable {run_dir / slurm.SCRIPT_NAME}" in log.read_text()
    assert [j["job_id"] for j in slurm.read_jobs(run_dir)] == ["5151"]
    step = run_dir / "checkpoints" / "step-000000007"
    step.mkdir(parents=True)
    (step / "manifest.json").write_text(json.dumps({"step": 7, "files": {}}))
    assert main(["slurm", "status", str(run_dir), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["job_id"] == "5151" and info["state"] == "RUNNING" and info["restarts"] == 1
    assert info["last_checkpoint"] == str(step) and info["logs"][0] == str(run_dir / "slurm-5151.out")
    assert main(["slurm", "cancel", str(run_dir)]) == 0
    assert "scancel 5151" in log.read_text()
    assert main(["slurm", "status", str(tmp_path / "never-submitted")]) == 2
