#!/usr/bin/env bash
# Run a command on a rate-limited loopback: a fresh network namespace whose only
# interface, lo, is shaped with a token bucket (tc tbf).
#
#   scripts/slow_loopback.sh RATE -- CMD...        (as root)
#   scripts/slow_loopback.sh 1gbit -- mpiexec -n 2 python scripts/handoff_slow_link.py
#
# - RATE is tc's rate syntax (1gbit, 500mbit, ...).
# - Inside the namespace, lo is the only interface (no route out), so every byte the
#   command sends goes through the shaped queue. Both directions of a loopback
#   connection share that one queue: RATE is the sum of the two directions.
# - MPICH is pushed off shared memory onto TCP (MPIR_CVAR_NOLOCAL=1,
#   MPIR_CVAR_CH4_NETMOD=ofi, FI_PROVIDER=tcp), and an `mpiexec` as CMD gets
#   `-hosts 127.0.0.1` (unless it names hosts or an interface itself) so that hydra
#   uses the namespace's loopback even where the host name resolves elsewhere. Set
#   SLOW_LOOPBACK_NO_MPI_ENV=1 to leave the environment alone.
# - Afterwards it prints `tc -s qdisc show dev lo` (the bytes that crossed the queue;
#   SLOW_LOOPBACK_STATS=FILE also writes them to FILE) and always deletes the namespace
#   (on success, failure, or Ctrl-C). Its exit status is CMD's.
# - Env: SLOW_LOOPBACK_BURST (default 1mb), SLOW_LOOPBACK_LATENCY (default 50ms).
set -u

usage() { echo "usage: $0 RATE -- CMD..." >&2; exit 2; }
[ $# -ge 3 ] || usage
RATE=$1; shift
[ "$1" = "--" ] || usage
shift
[ "$(id -u)" = 0 ] || { echo "$0: needs root (ip netns, tc)" >&2; exit 2; }
command -v ip >/dev/null && command -v tc >/dev/null || { echo "$0: needs ip and tc (iproute2)" >&2; exit 2; }

BURST=${SLOW_LOOPBACK_BURST:-1mb}
LATENCY=${SLOW_LOOPBACK_LATENCY:-50ms}
NS="slowlo.$$.$(date +%s%N | tail -c 7)"

cleanup() {
    local rc=$?
    trap - EXIT INT TERM HUP
    if ip netns list 2>/dev/null | grep -qF -- "$NS"; then
        echo "--- tc -s qdisc show dev lo (namespace $NS, rate $RATE) ---"
        ip netns exec "$NS" tc -s qdisc show dev lo | tee ${SLOW_LOOPBACK_STATS:+"$SLOW_LOOPBACK_STATS"}
        # the command's processes must not outlive the namespace
        for pid in $(ip netns pids "$NS" 2>/dev/null); do kill -TERM "$pid" 2>/dev/null; done
        sleep 0.2
        for pid in $(ip netns pids "$NS" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null; done
        ip netns del "$NS" || echo "$0: could not delete namespace $NS" >&2
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM HUP

ip netns add "$NS" || exit 1
ip netns exec "$NS" ip link set lo up || exit 1
ip netns exec "$NS" tc qdisc add dev lo root tbf rate "$RATE" burst "$BURST" latency "$LATENCY" || exit 1
ip netns exec "$NS" tc qdisc show dev lo

if [ -z "${SLOW_LOOPBACK_NO_MPI_ENV:-}" ]; then
    export MPIR_CVAR_NOLOCAL=1 MPIR_CVAR_CH4_NETMOD=ofi FI_PROVIDER=tcp
    if [ "$(basename "$1")" = mpiexec ] || [ "$(basename "$1")" = mpirun ]; then
        placed=
        for a in "$@"; do
            case $a in -host|-hosts|-f|-hostfile|-machinefile|-iface) placed=1 ;; esac
        done
        if [ -z "$placed" ]; then
            first=$1; shift
            set -- "$first" -hosts 127.0.0.1 "$@"
        fi
    fi
fi

# not exec: the trap must run after CMD ends
ip netns exec "$NS" "$@"
