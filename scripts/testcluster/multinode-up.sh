#!/usr/bin/env bash
# Two "nodes" on this machine that are two network hosts (Debian/Ubuntu, root, iproute2 + util-linux):
#   node1 = $NET.11, node2 = $NET.12: network namespaces $NS-1/$NS-2, each joined by a veth to the
#   bridge $BRIDGE ($NET.1, this host). NET, NS and BRIDGE are this checkout's (lib.sh: a hash of its
#   path), so two checkouts on one machine each get their own. Private subnet, no default route in the namespaces and
#   ip_forward untouched: nothing can leave the machine. Each node has its own hostname (UTS namespace)
#   and its own /etc/hosts (mount namespace, bind mount of $LAB/two/hosts); files, processes and /tmp
#   are shared, like a cluster with a shared file system.
# Then, unless --network-only: a 2-node Slurm on them (one slurmctld on this host at $NET.1:PORT2, one
# slurmd per node, a private munged), all under $HPCTRAIN_SLURM_LAB/two (default /tmp/hpctrain-slurm-TAG/two).
# Idempotent and fast when already up. Last line: SLURM_CONF=PATH. Run a command on a node with
# node-exec.sh; remove everything with multinode-down.sh.
set -euo pipefail
. "$(dirname "$0")/lib.sh"
need_root
command -v ip >/dev/null || unable "no 'ip' command (iproute2) to build network namespaces"
command -v nsenter >/dev/null && command -v unshare >/dev/null || unable "no nsenter/unshare (util-linux)"
L=$LAB/two; export SLURM_CONF=$L/slurm.conf
HOST=$(hostname -s)   # SlurmctldHost must be the real short hostname, or "This host (...) not a valid controller"
mkdir -p "$L/state/ctld" "$L/log" "$L/run"

network_ready() {
  ip -br addr show "$BRIDGE" 2>/dev/null | grep -qF "$NET.1/24" || return 1
  for i in 1 2; do ip -n "$NS-$i" -br addr show htceth0 2>/dev/null | grep -qF "$NET.1$i/24" || return 1; done
}

NET_NEW=0
network_up() {
  network_ready && return 0
  NET_NEW=1
  bash "$(dirname "$0")/multinode-down.sh" --network-only >/dev/null   # a half-built network from before
  ip link add "$BRIDGE" type bridge 2>/dev/null || unable "cannot create a bridge (no CAP_NET_ADMIN?)"
  ip addr add "$NET.1/24" dev "$BRIDGE"
  ip link set "$BRIDGE" up
  for i in 1 2; do
    ip netns add "$NS-$i" 2>/dev/null || { bash "$(dirname "$0")/multinode-down.sh" --network-only; unable "cannot create network namespaces"; }
    ip link add "${NS}v$i" type veth peer name htceth0 netns "$NS-$i"
    ip link set "${NS}v$i" master "$BRIDGE" up
    ip -n "$NS-$i" addr add "$NET.1$i/24" dev htceth0
    ip -n "$NS-$i" link set htceth0 up
    ip -n "$NS-$i" link set lo up
  done
  if [ "$(cat /proc/sys/net/bridge/bridge-nf-call-iptables 2>/dev/null || echo 0)" = 1 ]; then
    echo "note: bridged traffic passes iptables (br_netfilter); a FORWARD policy of DROP would cut node1<->node2" >&2
  fi
}

network_up
# Node names must resolve on every node (torchrun's MASTER_ADDR is the head node's hostname).
printf '127.0.0.1 localhost\n%s.1 %s\n%s.11 node1\n%s.12 node2\n' "$NET" "$HOST" "$NET" "$NET" > "$L/hosts"
if [ "${1:-}" = --network-only ]; then
  [ "$NET_NEW" = 1 ] && echo "network started" || echo "network already up"
  echo "node1 $NET.11, node2 $NET.12 (run commands there with node-exec.sh 1|2 CMD)"; exit 0
fi

install_slurm
CONF="$(slurm_conf "$L" "$HOST" "$NET.1" "$PORT2" $(( PORT2 + 1 )))
NodeName=node1 NodeAddr=$NET.11 CPUs=$(nproc) RealMemory=1000 State=UNKNOWN
NodeName=node2 NodeAddr=$NET.12 CPUs=$(nproc) RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=node1,node2 Default=YES MaxTime=INFINITE State=UP"
if [ "$NET_NEW" = 0 ] && [ "$(cat "$SLURM_CONF" 2>/dev/null)" = "$CONF" ] && alive munged "$L/munge/munged.pid" \
   && alive slurmctld "$L/run/slurmctld.pid" && alive slurmd "$L/run/slurmd-node1.pid" \
   && alive slurmd "$L/run/slurmd-node2.pid" && scontrol ping 2>/dev/null | grep -q UP; then
  echo "slurm 2-node already up: node1 node2"; echo "SLURM_CONF=$SLURM_CONF"; exit 0
fi
stop slurmd "$L/run/slurmd-node1.pid"; stop slurmd "$L/run/slurmd-node2.pid"; stop slurmctld "$L/run/slurmctld.pid"
printf '%s\n' "$CONF" > "$SLURM_CONF"
start_munged "$L/munge"
slurmctld -c   # on the host, listening on every address including the bridge's
for _ in $(seq 100); do scontrol ping 2>/dev/null | grep -q UP && break; sleep 0.1; done
T0=$(( $(date +%s) - 1 ))
for i in 1 2; do
  # nsenter, not `ip netns exec`: the latter remounts /sys and hides /sys/fs/cgroup, and slurmd then
  # fails with "No filesystem mounted on /sys/fs/cgroup". %n in the conf keeps the two slurmds' files apart.
  nsenter --net="/run/netns/$NS-$i" unshare --uts --mount sh -c \
    "mount --bind '$L/hosts' /etc/hosts && hostname node$i && exec slurmd -N node$i"
done
wait_idle "$T0" node1 node2
echo "slurm 2-node started: node1 node2"; echo "SLURM_CONF=$SLURM_CONF"
