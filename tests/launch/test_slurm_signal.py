"""``hpctrain slurm --signal USR1|USR2|HUP|TERM`` and ``--hang-timeout``: the #SBATCH line, the batch
shell's trap and the ranks' ``checkpoint.signals`` agree for every signal and every runtime; the requeue
and the forwarding run in the batch shell, never inside a container; anything else is refused before
anything is written (issue 17, point 3). The batch shell's logic per signal runs under bash in
test_slurm_render.py; the real Slurm chain in tests/slurm/test_requeue.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hpctrain.cli import main
from hpctrain.config import load_config
from hpctrain.launch import slurm
from hpctrain.launch.slurm import SlurmOptions, render, sbatch_job

WORKDIR = Path("/work/project")  # never created: rendering only resolves paths
CONFIG = ["data.name=synthetic_tiny", "model.name=mnist_cnn", "run.dir=runs/signal"]
RUNTIMES: dict[str, dict[str, Any]] = {
    "host": {},
    "apptainer": {"container": "/images/pytorch.sif", "container_runtime": "apptainer"},
    "pyxis": {"container": "nvcr.io#nvidia/pytorch:24.05-py3", "container_runtime": "pyxis"},
}


def _job(config: list[str] = CONFIG, **options: Any) -> slurm.SbatchJob:
    opts = SlurmOptions(nodes=2, time="04:00:00", gpus_per_node=4, python="python", **options)
    return sbatch_job(opts, config, environ={}, workdir=WORKDIR)


@pytest.mark.parametrize("runtime", sorted(RUNTIMES))
@pytest.mark.parametrize("sig", slurm.SIGNALS)
def test_header_trap_and_ranks_agree_and_the_shell_does_the_slurm_calls(sig: str, runtime: str) -> None:
    plan = _job(signal=sig, **RUNTIMES[runtime])
    text = render(plan)
    assert f"#SBATCH --signal=B:{sig}@{plan.signal_lead_s}\n" in text
    # the preemption signal and TERM (a preemption's grace time signals every process, the batch shell too)
    traps = [line for line in text.splitlines() if line.startswith("trap ")]
    assert [line.rsplit(" ", 1)[1] for line in traps] == ([sig, "TERM"] if sig != "TERM" else ["TERM"])
    for line in traps:
        trapped = line.rsplit(" ", 1)[1]
        how = f'kill -{trapped} "$step"' if trapped in slurm.SRUN_PASSES else \
            f'scancel --signal={trapped} "$SLURM_JOB_ID"'
        assert line.startswith(f"trap 'forward {trapped}; {how}") and line.endswith(f"' {trapped}"), line
    # the ranks save on it (and on Slurm's own SIGTERM): the default list holds USR1 and TERM already
    ranks = load_config(None, list(plan.config_args)).checkpoint.signals
    assert ranks == (["SIGUSR1", "SIGTERM"] if sig in ("USR1", "TERM") else [f"SIG{sig}", "SIGTERM"])
    # Slurm's commands run in the batch shell on the host; the step (in the container) has none
    step = text[text.index("srun "):text.index("step=$!")]
    assert "scontrol" not in step and "scancel" not in step
    assert text.index('scontrol requeue "$SLURM_JOB_ID"') > text.index("step=$!")


def test_signal_names_are_normalised_and_hang_timeout_passed_on_only_when_given() -> None:
    assert _job(signal="sighup").signal == "HUP"
    assert "--hang-timeout" not in render(_job())
    assert "--shutdown-timeout=300 --hang-timeout=120 \\\n" in render(_job(hang_timeout_s=120.0))
    assert " --hang-timeout=0 " in render(_job(hang_timeout_s=0.0))  # 0 turns the watchdog off


def test_a_users_own_signal_list_that_holds_the_signal_is_kept() -> None:
    plan = _job([*CONFIG, "checkpoint.signals=[SIGUSR2]"], signal="USR2")
    assert load_config(None, list(plan.config_args)).checkpoint.signals == ["SIGUSR2"]


@pytest.mark.parametrize(("options", "message"), [
    (["--signal", "KILL"], "--signal 'KILL' is not one of USR1, USR2, HUP, TERM; hint: HUP where USR1 is taken"),
    (["--signal", "USR1@60"], "--signal 'USR1@60' is not one of USR1, USR2, HUP, TERM"),
    (["checkpoint.signals=[SIGUSR2]", "--signal", "HUP"],
     "checkpoint.signals=['SIGUSR2'] does not hold SIGHUP, the signal --signal HUP has Slurm send"),
    (["--hang-timeout", "-5"], "--hang-timeout -5 must be >= 0"),
])
def test_bad_values_fail_before_anything_is_written(options: list[str], message: str, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    config = [o for o in options if o.startswith("checkpoint.")]
    flags = [o for o in options if o not in config]
    assert main(["slurm", "data.name=synthetic_tiny", f"run.dir={run_dir}", *config,
                 "--nodes", "1", "--time", "01:00:00", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not run_dir.exists()


def test_the_lead_counts_one_validation(tmp_path: Path) -> None:
    """A signal during validation is seen at the step after it: the measured lead includes the
    longest validation in metrics.jsonl (count / samples per second)."""
    step = tmp_path / "checkpoints" / "step-000000010"
    step.mkdir(parents=True)
    (step / "manifest.json").write_text(json.dumps({"step": 10, "files": {}, "save_s": 40.2}))
    rows = [{"step": 5, "loss": 1.0}, {"step": 10, "val_count": 1000, "eval_samples_per_s": 40.0},
            {"step": 20, "val_count": 1000, "eval_samples_per_s": 50.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 2')
    assert slurm.measured_validation_s(tmp_path) == 25.0
    assert slurm.signal_lead(SlurmOptions(nodes=1, time="02:00:00"), 7200, tmp_path) == \
        106 + slurm.SIGNAL_MARGIN_S  # ceil(2 x 40.2 + 25)
