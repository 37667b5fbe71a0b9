"""Launchers: local ranks through torchrun (local.py), sbatch scripts for Slurm (slurm.py,
slurm_jobs.py), containers (container.py), and ``hpctrain doctor`` (doctor.py)."""

# Seconds the ranks get to save and exit after a forwarded signal before SIGKILL (`hpctrain run
# --shutdown-timeout`): here, not in local.py, so the CLI's default costs no torch import.
DEFAULT_SHUTDOWN_TIMEOUT_S = 300
DEFAULT_HANG_TIMEOUT_S = 300  # half the default collective timeout (parallel.init_timeout_s = 600)
