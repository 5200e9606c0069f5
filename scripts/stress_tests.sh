#!/usr/bin/env bash
# Runs the given tests N times in a row with `stress --cpu 2` beside them (Debian's stress,
# installed if missing): a test that is flaky under load fails here first.
#
#   bash scripts/stress_tests.sh 10 tests/test_rollout_server.py::test_flush_cache_is_refused_while_requests_run
#
# Prints one line per run and exits non-zero at the first failure (its output is kept).
set -uo pipefail
n=${1:?usage: stress_tests.sh N TEST_ID...}
shift
PY=${PY:-.venv/bin/python}
command -v stress >/dev/null || apt-get install -y -qq stress >/dev/null \
  || { apt-get update -qq && apt-get install -y -qq stress >/dev/null; }
stress --cpu 2 >/dev/null 2>&1 &
load=$!
trap 'kill "$load" 2>/dev/null; pkill -P "$load" 2>/dev/null' EXIT
log=$(mktemp "${TMPDIR:-/tmp}/stress-tests.XXXXXX")
for ((i = 1; i <= n; i++)); do
  start=$(date +%s)
  if AREAL_REQUIRE_SYSDEPS=1 "$PY" -m pytest -q -p no:cacheprovider -W ignore "$@" >"$log" 2>&1; then
    echo "run $i/$n passed in $(($(date +%s) - start)) s"
  else
    echo "run $i/$n FAILED after $(($(date +%s) - start)) s; output: $log"
    tail -40 "$log"
    exit 1
  fi
done
rm -f "$log"
echo "all $n runs passed under stress --cpu 2"
