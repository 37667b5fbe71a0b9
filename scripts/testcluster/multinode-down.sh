#!/usr/bin/env bash
# Undo multinode-up.sh: cancel the 2-node cluster's jobs, stop only the daemons it started (pid files,
# checked by process name), then delete the namespaces, veths and bridge.
# --slurm-only / --network-only: just that half. --purge: also remove $HPCTRAIN_SLURM_LAB/two.
# Installed packages stay.
. "$(dirname "$0")/lib.sh"
L=$LAB/two; export SLURM_CONF=$L/slurm.conf
if [ "${1:-}" != --network-only ]; then
  alive slurmctld "$L/run/slurmctld.pid" && cancel_all
  stop slurmd "$L/run/slurmd-node1.pid"; stop slurmd "$L/run/slurmd-node2.pid"
  stop slurmctld "$L/run/slurmctld.pid"; stop munged "$L/munge/munged.pid"
fi
if [ "${1:-}" != --slurm-only ]; then
  for i in 1 2; do ip netns del "$NS-$i" 2>/dev/null; ip link del "${NS}v$i" 2>/dev/null; done
  ip link del "$BRIDGE" 2>/dev/null
fi
[ "${1:-}" = --purge ] && rm -rf "$L"
true
