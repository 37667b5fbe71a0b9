# Shared by the test-cluster scripts beside this file (sourced, not run). Debian/Ubuntu, root.
# Everything lives under $LAB (default /tmp/hpctrain-slurm-$TAG): configs, munge keys, state, logs, pid files.
# Nothing outside it is written except what apt-get installs and, for the 2-node cluster, the
# network namespaces, veths and bridge that multinode-up.sh creates and multinode-down.sh removes.
#
# Per checkout: two checkouts testing on one machine must not share a cluster (one munged's socket lock,
# one controller's ports) or a bridge. TAG, a short hash of this checkout's path, names the directory,
# the namespaces, veths and bridge, and picks the ports, the 2-node subnet and the first job id (a job's
# rendezvous port is 20000 + job id mod 20000, so the clusters' jobs must not share ids either).
CHECKOUT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd -P)
TAG=$(printf %s "$CHECKOUT" | sha256sum | cut -c1-6)
SLOT=$(( 16#${TAG:0:4} % 400 ))                 # 0..399
LAB=${HPCTRAIN_SLURM_LAB:-/tmp/hpctrain-slurm-$TAG}
PORT1=$(( 6800 + 2 * SLOT ))                     # 1-node slurmctld; slurmd on PORT1 + 1 (6800..7599)
PORT2=$(( 7600 + 2 * SLOT ))                     # 2-node slurmctld; slurmd on PORT2 + 1 (7600..8399)
FIRST_JOB=$(( 1 + 50 * SLOT ))
NET="10.$(( 100 + SLOT / 200 )).$(( SLOT % 200 ))" # the 2-node /24: host .1, node1 .11, node2 .12
BRIDGE=htcbr$TAG                                 # interface names: at most 15 characters
NS=htc$TAG                                       # namespaces $NS-1, $NS-2; host veths ${NS}v1, ${NS}v2
PKGS="slurmctld slurmd slurm-client munge"

die() { echo "$*" >&2; exit 1; }
# unable: this machine cannot host the cluster (exit 3, which the tests turn into a skip with this reason).
unable() { echo "cannot run here: $*" >&2; exit 3; }

need_root() { [ "$(id -u)" = 0 ] || unable "needs root (installs packages, starts daemons, creates namespaces)"; }

# Install Debian's Slurm and munge once; postinst cannot start services without systemd, which is fine:
# the scripts start their own daemons with their own configs.
install_slurm() {
  local have
  have=$(dpkg-query -W -f='${db:Status-Abbrev}\n' $PKGS 2>/dev/null | grep -c '^ii' || true)
  [ "$have" = 4 ] && return 0
  command -v apt-get >/dev/null || unable "Slurm is not installed and there is no apt-get to install it ($PKGS)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get -o DPkg::Lock::Timeout=300 update -qq || unable "apt-get update failed"
  apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends $PKGS >/dev/null \
    || unable "apt-get install $PKGS failed"
}

# alive NAME PIDFILE: the pid file names a live process called NAME (never trust a stale pid).
alive() { local p; p=$(cat "$2" 2>/dev/null) && [ "$(cat "/proc/$p/comm" 2>/dev/null)" = "$1" ]; }

# stop NAME PIDFILE: stop only a process we started (pid file + name), then forget it.
stop() {
  local p
  if alive "$1" "$2"; then
    p=$(cat "$2"); kill "$p" 2>/dev/null
    for _ in $(seq 100); do [ -d "/proc/$p" ] || break; sleep 0.1; done
    [ -d "/proc/$p" ] && kill -9 "$p" 2>/dev/null
    echo "stopped $1 ($p)"
  fi
  rm -f "$2"
}

# start_munged DIR: a private munged whose socket is a file path (reachable from every namespace).
# The directory must be mode 711: with 700, clients get "Socket is inaccessible".
start_munged() {
  local d=$1
  alive munged "$d/munged.pid" && return 0
  mkdir -p "$d"
  [ -s "$d/munge.key" ] || dd if=/dev/urandom of="$d/munge.key" bs=128 count=1 status=none
  chown -R munge:munge "$d"; chmod 711 "$d"; chmod 400 "$d/munge.key"
  rm -f "$d/munge.socket" "$d/munge.socket.lock"
  runuser -u munge -- /usr/sbin/munged --socket="$d/munge.socket" --key-file="$d/munge.key" \
    --pid-file="$d/munged.pid" --log-file="$d/munged.log" --seed-file="$d/munged.seed" \
    || die "munged did not start: $(tail -3 "$d/munged.log" 2>/dev/null)"
}

# slurm_conf LAB CTLD_HOST CTLD_ADDR CTLD_PORT SLURMD_PORT: the settings both clusters share
# (root jobs, no cgroups or accounting, fast scheduling, requeue allowed). Nodes are appended by the caller.
slurm_conf() {
  cat <<CONF
ClusterName=htc$TAG$(basename "$1")
FirstJobId=$FIRST_JOB
SlurmctldHost=$2($3)
SlurmctldPort=$4
SlurmdPort=$5
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$1/munge/munge.socket,cred_expire=10
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$1/state/ctld
SlurmdSpoolDir=$1/state/%n
SlurmctldPidFile=$1/run/slurmctld.pid
SlurmdPidFile=$1/run/slurmd-%n.pid
SlurmctldLogFile=$1/log/slurmctld.log
SlurmdLogFile=$1/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=${TASK_PLUGIN:-task/none}
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerParameters=batch_sched_delay=0,bf_interval=2,sched_interval=2
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
JobRequeue=1
KillWait=5
MinJobAge=3600
CONF
}

# wait_idle SINCE NODE...: every node idle, registered by a slurmd started at or after SINCE (epoch s).
wait_idle() {
  local since=$1 ok n reg st; shift
  for _ in $(seq 300); do
    ok=0
    for n in "$@"; do
      st=$(sinfo -h -n "$n" -o %T 2>/dev/null || true)
      reg=$(scontrol show node "$n" 2>/dev/null | grep -oP 'SlurmdStartTime=\K\S+' || true)
      case $st in
        idle) [ "$(date -d "$reg" +%s 2>/dev/null || echo 0)" -ge "$since" ] && ok=$((ok + 1)) ;;
        down*|drain*) scontrol update nodename="$n" state=resume 2>/dev/null || true ;;
      esac
    done
    [ "$ok" = $# ] && return 0
    sleep 0.2
  done
  sinfo -N >&2; tail -5 "$LAB"/*/log/*.log >&2; die "nodes not ready: $*"
}

# cancel_all: cancel this cluster's jobs and wait until they are gone (the controller must be up).
cancel_all() {
  local jobs
  jobs=$(squeue -h -o %i 2>/dev/null) || return 0
  [ -z "$jobs" ] && return 0
  scancel $jobs 2>/dev/null
  for _ in $(seq 150); do [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.2; done
}
