#!/usr/bin/env bash
# Stop what slurm-up.sh started (only processes named in its pid files), after cancelling its jobs.
# --purge also removes its directory (configs, state, logs). Installed packages stay.
. "$(dirname "$0")/lib.sh"
L=$LAB/one; export SLURM_CONF=$L/slurm.conf
alive slurmctld "$L/run/slurmctld.pid" && cancel_all
for f in "$L"/run/slurmd-*.pid; do stop slurmd "$f"; done
stop slurmctld "$L/run/slurmctld.pid"
stop munged "$L/munge/munged.pid"
[ "${1:-}" = --purge ] && rm -rf "$L"
true
