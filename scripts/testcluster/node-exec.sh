#!/usr/bin/env bash
# node-exec.sh N COMMAND [ARG...]: run COMMAND "on" nodeN of multinode-up.sh: in its network namespace,
# with its hostname and /etc/hosts (private UTS and mount namespaces), in the foreground.
set -euo pipefail
. "$(dirname "$0")/lib.sh"
n=${1:?usage: node-exec.sh N COMMAND [ARG...]}; shift
[ -e "/run/netns/$NS-$n" ] || die "no node$n: run multinode-up.sh first"
exec nsenter --net="/run/netns/$NS-$n" unshare --uts --mount sh -c \
  'mount --bind "$0" /etc/hosts && hostname "$1" && shift && exec "$@"' "$LAB/two/hosts" "node$n" "$@"
