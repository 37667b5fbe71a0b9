#!/usr/bin/env bash
# A real single-node Slurm on this machine for the tests (Debian/Ubuntu, root, no systemd or cgroups
# needed): Debian's slurmctld + slurmd + a private munged, each with its own config under
# $HPCTRAIN_SLURM_LAB/one (default /tmp/hpctrain-slurm-TAG/one, TAG a hash of this checkout's path: see
# lib.sh), on ports PORT1/PORT1+1 of this checkout (within 6800..7599) so that it clashes neither with a
# Slurm already on the machine nor with another checkout's. Idempotent: returns at once when it is already up.
# Last line of output: SLURM_CONF=PATH (export it to use the cluster). Stop with slurm-down.sh.
set -euo pipefail
. "$(dirname "$0")/lib.sh"
need_root
install_slurm
L=$LAB/one; export SLURM_CONF=$L/slurm.conf
NODE=$(hostname -s)
mkdir -p "$L/state/ctld" "$L/log" "$L/run"
HW=$(slurmd -C | sed -nE '1s/^NodeName=[^ ]+ (.*) RealMemory=.*/\1/p')
MEM=$(( $(awk '/MemTotal/{print $2}' /proc/meminfo) * 9 / 10240 ))   # 90% of RAM, MiB
# the 1-node cluster binds each task to its CPUs (tests/slurm checks a rank's affinity); the 2-node one
# does not: both of its nodes share this machine's CPUs, and binding could put both ranks on one core
CONF="$(TASK_PLUGIN=task/affinity slurm_conf "$L" "$NODE" 127.0.0.1 "$PORT1" $(( PORT1 + 1 )))
NodeName=$NODE NodeAddr=127.0.0.1 $HW RealMemory=$MEM State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP"
if [ "$(cat "$SLURM_CONF" 2>/dev/null)" = "$CONF" ] && alive munged "$L/munge/munged.pid" \
   && alive slurmctld "$L/run/slurmctld.pid" && alive slurmd "$L/run/slurmd-$NODE.pid" \
   && scontrol ping 2>/dev/null | grep -q UP; then
  echo "slurm 1-node already up: $NODE"; echo "SLURM_CONF=$SLURM_CONF"; exit 0
fi
# Anything missing or a changed config: restart our daemons from a clean controller state.
stop slurmd "$L/run/slurmd-$NODE.pid"; stop slurmctld "$L/run/slurmctld.pid"
printf '%s\n' "$CONF" > "$SLURM_CONF"
start_munged "$L/munge"
slurmctld -c   # -c: forget jobs of an earlier life of this cluster
for _ in $(seq 100); do scontrol ping 2>/dev/null | grep -q UP && break; sleep 0.1; done
T0=$(( $(date +%s) - 1 ))
slurmd -N "$NODE"
wait_idle "$T0" "$NODE"
echo "slurm 1-node started: $NODE"; echo "SLURM_CONF=$SLURM_CONF"
