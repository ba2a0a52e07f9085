#!/usr/bin/env bash
# How does a job end when one rank dies? One line per mode and world size: exit status,
# wall time, processes of the job left behind. The numbers in docs/reliability.md.
#
#   scripts/measure_rank_death.sh            # with gradfuse (GRADFUSE_STALL_TIMEOUT_S=5)
#   scripts/measure_rank_death.sh --plain    # plain mpi4py, no gradfuse (hangs are cut at 25 s)
#
# MODES and NS override the modes and world sizes; T the stall timeout.
set -u
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# BIN: the folder with mpiexec and python (default: the checkout's .venv/bin, as README sets
# it up, else where mpiexec is on PATH)
if [ -z "${BIN:-}" ]; then
  if [ -x "$ROOT/.venv/bin/mpiexec" ]; then BIN="$ROOT/.venv/bin"
  elif command -v mpiexec >/dev/null; then BIN="$(dirname "$(command -v mpiexec)")"
  else echo "measure_rank_death.sh: no mpiexec in $ROOT/.venv/bin or on PATH; set BIN" >&2; exit 2; fi
fi
PLAIN="${1:-}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" GRADFUSE_STALL_TIMEOUT_S="${T:-5}"
MARK="measure-$$"
cd "$ROOT"
for mode in ${MODES:-exit0 exit1 exception abort sigkill os_exit data_hang exit0_plainwait clean clean_late}; do
  for n in ${NS:-2 3}; do
    s=$(date +%s.%N)
    timeout -s KILL 25 "$BIN/mpiexec" -n "$n" "$BIN/python" tests/scripts/die.py "$mode" $PLAIN "$MARK" \
        > "/tmp/$MARK-$mode-$n.log" 2>&1
    rc=$?
    e=$(date +%s.%N)
    sleep 0.5
    left=$(pgrep -f "$MARK" | wc -l)
    [ "$rc" = 137 ] && what="HANG (killed at 25 s)" || what="exit $rc"
    printf "%-16s n=%d  %-22s %5.1f s  left=%d  (log /tmp/%s-%s-%d.log)\n" \
        "$mode" "$n" "$what" "$(echo "$e - $s" | bc)" "$left" "$MARK" "$mode" "$n"
    pgrep -f "$MARK" | xargs -r kill -9 2>/dev/null
  done
done
