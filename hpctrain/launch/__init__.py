"""Launchers: local processes through torchrun (Slurm and containers arrive later)."""
