"""Launchers: local ranks through torchrun (local.py), sbatch scripts for Slurm (slurm.py,
slurm_jobs.py), containers (container.py), and ``hpctrain doctor`` (doctor.py)."""
