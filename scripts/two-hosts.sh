#!/usr/bin/env bash
# A test bed of two "hosts" on one Linux machine, for MPI jobs across hosts (README, "Several
# hosts"; docs/several-hosts.md). Needs root (creating network namespaces) and iproute2.
#
#   two-hosts.sh up                 create the bed; idempotent (whatever is left of an earlier
#                                   bed, also one whose test was killed, is removed first)
#   two-hosts.sh down               remove it, ending the processes still inside; idempotent
#   two-hosts.sh check              exit 0 when the bed is up (both hosts, link up, addresses)
#   two-hosts.sh mpirun ARGS...     mpirun started on hosta, daemons on hostb through `agent`,
#                                   TCP restricted to the bed's link, e.g.
#                                     two-hosts.sh mpirun --host hosta:2,hostb:2 --oversubscribe \
#                                       target/release/lockstep info
#   two-hosts.sh exec HOST CMD...   run CMD on HOST (hosta or hostb)
#   two-hosts.sh agent HOST CMD...  Open MPI's launch agent (plm_rsh_agent) in place of ssh:
#                                   runs the remote command line CMD on HOST
#
# Each host is a network namespace with its own hostname (a UTS namespace entered per
# command), its own address on a veth pair (hosta 10.213.0.1, hostb 10.213.0.2 on
# 10.213.0.0/24) and a hosts file naming both (/etc/netns/NS/hosts, which `ip netns exec`
# shows as /etc/hosts). Both hosts see this machine's filesystem, as cluster nodes share one.
# As over ssh, a command on hostb starts with a login-like environment (PATH, HOME, USER,
# LANG, TMPDIR), not the caller's: pass variables to the ranks with mpirun's `-x NAME`.
#
# Environment: TWO_HOSTS_PREFIX names the namespaces (default lockstep: lockstep-hosta and
# lockstep-hostb); one bed per prefix and machine at a time. Read by `mpirun` and `agent`
# (colon-separated lists of existing folders):
#   TWO_HOSTS_READONLY  folders hostb sees read-only (to check that only the chief, on
#                       hosta, writes a run folder)
#   TWO_HOSTS_LOCAL     folders hostb does not share: it sees an empty folder of its own
#                       in their place (a tmpfs), as on a node-local disk
set -euo pipefail

self=$(readlink -f "${BASH_SOURCE[0]}")
prefix=${TWO_HOSTS_PREFIX:-lockstep}
subnet=10.213.0.0/24
hosts=(hosta hostb)
declare -A addr=([hosta]=10.213.0.1 [hostb]=10.213.0.2)
link=lsbed0

say() { printf 'two-hosts: %s\n' "$*" >&2; }
die() { say "error: $*"; exit 1; }
ns_of() { printf '%s-%s' "$prefix" "$1"; }
# Whether the network namespace $1 exists. The listing is read whole before matching: with
# pipefail, `ip ... | grep -q` fails at random when grep exits before ip has written its
# last line (ip then dies of SIGPIPE), which once made `up` report a healthy bed as down.
has_ns() {
  local list
  list=$(ip netns list 2>/dev/null || true)
  grep -qw -- "$1" <<<"$list"
}
known_host() { [[ $1 == hosta || $1 == hostb ]] || die "unknown host '$1' (the bed has hosta and hostb)"; }

need_root() {
  [ "$(id -u)" -eq 0 ] || die "the two-host bed needs root (it creates network namespaces); run as root or with sudo"
  command -v ip >/dev/null 2>&1 || die "'ip' is missing: install iproute2 (make setup does)"
  command -v unshare >/dev/null 2>&1 || die "'unshare' is missing: install util-linux"
}

down() {
  need_root
  for h in "${hosts[@]}"; do
    local ns
    ns=$(ns_of "$h")
    if has_ns "$ns"; then
      # End what still runs inside (daemons or ranks of a failed test); these are the bed's
      # own processes, started by `agent`, `exec` or `mpirun` of this script.
      local pids
      pids=$(ip netns pids "$ns" 2>/dev/null || true)
      if [ -n "$pids" ]; then
        # shellcheck disable=SC2086
        kill -KILL $pids 2>/dev/null || true
      fi
      ip netns del "$ns" 2>/dev/null || die "cannot delete network namespace $ns"
    fi
    rm -rf "/etc/netns/$ns"
  done
}

up() {
  need_root
  down
  local a b err
  a=$(ns_of hosta)
  b=$(ns_of hostb)
  if ! err=$(ip netns add "$a" 2>&1); then
    die "this machine does not allow network namespaces (ip netns add $a: $err); the two-host bed needs root with CAP_SYS_ADMIN and CAP_NET_ADMIN (a container must be privileged)"
  fi
  ip netns add "$b" || die "cannot create network namespace $b"
  ip link add "$link" netns "$a" type veth peer name "$link" netns "$b" \
    || { down; die "cannot create the veth pair between $a and $b"; }
  for h in "${hosts[@]}"; do
    local ns
    ns=$(ns_of "$h")
    ip -n "$ns" link set lo up
    ip -n "$ns" addr add "${addr[$h]}/24" dev "$link"
    ip -n "$ns" link set "$link" up
    mkdir -p "/etc/netns/$ns"
    printf '127.0.0.1\tlocalhost\n%s\thosta\n%s\thostb\n' "${addr[hosta]}" "${addr[hostb]}" \
      >"/etc/netns/$ns/hosts.tmp"
    mv "/etc/netns/$ns/hosts.tmp" "/etc/netns/$ns/hosts"
    printf '%s\n' "$h" >"/etc/netns/$ns/hostname"
  done
  check || { down; die "the bed was created but its link is not up"; }
  say "up: hosta ${addr[hosta]} ($a), hostb ${addr[hostb]} ($b), link $link on $subnet"
}

# One look at the bed; says what is missing and returns 1 when it is not up.
check_once() {
  local h ns shown
  for h in "${hosts[@]}"; do
    ns=$(ns_of "$h")
    has_ns "$ns" || { say "not up: no namespace $ns"; return 1; }
    shown=$(ip -n "$ns" -o addr show dev "$link" 2>/dev/null || true)
    grep -q "inet ${addr[$h]}/" <<<"$shown" \
      || { say "not up: $ns has no $link with ${addr[$h]}"; return 1; }
    shown=$(ip -n "$ns" -o link show dev "$link" 2>/dev/null || true)
    grep -q 'state UP' <<<"$shown" \
      || { say "not up: the link $link of $ns is down"; return 1; }
  done
}

# The bed is up; a link that was just set up gets a few seconds to report so (its carrier
# comes up asynchronously), then whatever is missing is said.
check() {
  need_root
  local try
  for try in 1 2 3 4 5 6 7 8 9 10; do
    check_once 2>/dev/null && return 0
    sleep 0.5
  done
  check_once
}

# Runs "$@" on host $1 in a fresh UTS namespace that carries the host's name.
on() {
  local h=$1
  shift
  known_host "$h"
  has_ns "$(ns_of "$h")" \
    || die "the bed is not up (no namespace $(ns_of "$h")): run '$self up' first"
  exec ip netns exec "$(ns_of "$h")" unshare --uts -- \
    sh -c 'echo "$0" >/proc/sys/kernel/hostname && exec "$@"' "$h" "$@"
}

# The launch agent: like `ssh HOST CMD...`, runs the words CMD... joined by spaces as a shell
# command line on HOST, with a login-like environment, after making TWO_HOSTS_READONLY
# read-only and TWO_HOSTS_LOCAL unshared there (in that command's mount namespace only).
agent() {
  [ $# -ge 2 ] || die "usage: $self agent HOST COMMAND..."
  local h=$1
  shift
  known_host "$h"
  local line="$*"
  on "$h" env -i PATH="$PATH" HOME="${HOME:-/}" USER="${USER:-root}" LOGNAME="${USER:-root}" \
    LANG="${LANG:-C.UTF-8}" TMPDIR="${TMPDIR:-/tmp}" \
    TWO_HOSTS_READONLY="${TWO_HOSTS_READONLY:-}" TWO_HOSTS_LOCAL="${TWO_HOSTS_LOCAL:-}" \
    sh -c '
      IFS=:
      for d in $TWO_HOSTS_READONLY; do
        [ -n "$d" ] || continue
        { mount --bind "$d" "$d" && mount -o remount,bind,ro "$d" "$d"; } \
          || { echo "two-hosts: cannot make $d read-only on $(hostname)" >&2; exit 97; }
      done
      for d in $TWO_HOSTS_LOCAL; do
        [ -n "$d" ] || continue
        mount -t tmpfs -o size=64m two-hosts-local "$d" \
          || { echo "two-hosts: cannot unshare $d on $(hostname)" >&2; exit 97; }
      done
      unset IFS TWO_HOSTS_READONLY TWO_HOSTS_LOCAL
      eval "$0"' "$line"
}

run_mpirun() {
  on hosta mpirun \
    --mca plm_rsh_agent "$self agent" \
    --mca btl self,vader,tcp \
    --mca btl_tcp_if_include "$subnet" \
    --mca oob_tcp_if_include "$subnet" \
    "$@"
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
  up) up ;;
  down) down; say "down" ;;
  check) check && say "up" ;;
  mpirun) need_root; run_mpirun "$@" ;;
  exec) need_root; [ $# -ge 2 ] || die "usage: $self exec HOST COMMAND..."; on "$@" ;;
  agent) need_root; agent "$@" ;;
  *) die "usage: $self up | down | check | mpirun ARGS... | exec HOST CMD... | agent HOST CMD..." ;;
esac
