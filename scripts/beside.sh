#!/usr/bin/env bash
# Runs two commands at once and fails if either fails:
#
#   scripts/beside.sh LOG "BACKGROUND COMMAND" FOREGROUND COMMAND...
#
# The background command's output goes to LOG and is printed after it ends (its last lines,
# or all of it when it failed); the foreground
# command's streams as usual. `make test` uses it to run clippy and rustdoc (about 2 minutes
# of checking every crate on CI's 2 cores) while the tests run: the tests leave about a
# quarter of the cores idle (MPI jobs and child processes waiting on each other), which the
# checks fill. The background command ends before this script does, whatever the foreground
# command did, so nothing is left running.
set -uo pipefail
log=$1
background=$2
shift 2
mkdir -p "$(dirname "$log")"
bash -c "$background" >"$log" 2>&1 &
pid=$!
"$@"
front=$?
if kill -0 "$pid" 2>/dev/null; then
  echo "beside.sh: waiting for \`$background\` (output in $log)" >&2
fi
wait "$pid"
back=$?
echo "---- \`$background\` (exit $back; $log):"
if [ "$back" -eq 0 ]; then tail -n 5 "$log"; else cat "$log"; fi
if [ "$front" -ne 0 ]; then
  echo "beside.sh: \`$*\` failed (exit $front)" >&2
  exit "$front"
fi
if [ "$back" -ne 0 ]; then
  echo "beside.sh: \`$background\` failed (exit $back); its whole output is in $log" >&2
  exit "$back"
fi
