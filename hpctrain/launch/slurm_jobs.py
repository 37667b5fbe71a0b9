"""Submit, inspect and cancel the job of a run directory (``hpctrain slurm --submit | status | cancel``).

Slurm's own commands do the work (sbatch, squeue, sacct, scontrol, scancel); the run
directory remembers the job ids (``slurm-jobs.json``), so a user needs only the path.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

from hpctrain.checkpoint import layout
from hpctrain.core.errors import RunError, UserError
from hpctrain.core.protocol import read_status
from hpctrain.launch.slurm import read_jobs, record_job


class SlurmCommandError(RunError):
    """A Slurm command failed or is missing; the message has its output."""


def _slurm(*argv: str, check: bool = True) -> str:
    if shutil.which(argv[0]) is None:
        if not check:
            return ""
        raise SlurmCommandError(f"{argv[0]} not found on PATH; hint: run this on a Slurm login node "
                                "(or `module load slurm`)")
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=60)
    if proc.returncode != 0 and check:
        raise SlurmCommandError(f"`{' '.join(argv)}` failed (exit {proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout if proc.returncode == 0 else ""


def submit(script: Path, run_dir: Path, nodes: int) -> str:
    """sbatch the script; record and return the job id."""
    out = _slurm("sbatch", "--parsable", str(script)).strip()
    job_id = out.split(";")[0]
    if not job_id.isdigit():
        raise SlurmCommandError(f"sbatch printed {out!r}, not a job id")
    record_job(run_dir, job_id, script, nodes)
    return job_id


def last_job(run_dir: Path) -> str:
    jobs = read_jobs(run_dir)
    if not jobs:
        raise UserError(f"{run_dir} has no submitted job (no slurm-jobs.json); hint: hpctrain slurm ... --submit")
    return str(jobs[-1]["job_id"])


def scontrol_fields(job_id: str) -> dict[str, str]:
    text = _slurm("scontrol", "show", "job", "-o", job_id, check=False)
    return dict(item.split("=", 1) for item in text.split() if "=" in item)


def job_state(job_id: str) -> str:
    """PENDING / RUNNING / COMPLETED / ...; squeue first, then scontrol, then accounting."""
    state = _slurm("squeue", "-h", "-j", job_id, "-o", "%T", check=False).strip()
    if not state:
        state = scontrol_fields(job_id).get("JobState", "")
    if not state:
        lines = _slurm("sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State", check=False).split()
        state = lines[-1] if lines else ""
    return state or "UNKNOWN (not in squeue, scontrol or sacct)"


def status(run_dir: Path) -> dict[str, Any]:
    """What a user asks about a running or finished job, as one dict."""
    job_id = last_job(run_dir)
    fields = scontrol_fields(job_id)
    found = layout.committed(layout.checkpoints_dir(run_dir))
    return {"run_dir": str(run_dir), "job_id": job_id, "state": job_state(job_id),
            "restarts": int(fields["Restarts"]) if fields.get("Restarts", "").isdigit() else None,
            "outcome": read_status(run_dir).get("outcome"),
            "last_checkpoint": str(found[-1][1]) if found else None,
            "logs": [str(run_dir / f"slurm-{job_id}.{ext}") for ext in ("out", "err")],
            "submissions": len(read_jobs(run_dir))}


def cancel(run_dir: Path) -> str:
    job_id = last_job(run_dir)
    _slurm("scancel", job_id)
    return job_id
