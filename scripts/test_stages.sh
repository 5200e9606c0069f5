#!/usr/bin/env bash
# `make test`: the installs side by side, then the main suite beside the megatron-core 0.19
# stage, and one line of wall time per stage and the total, so every change sees what it
# cost (budget: 30 min on a 2-core machine, installs included), then the 25 slowest tests
# and the seconds per module (scripts/test_durations.py, from the stages' JUnit files in
# build/test-reports/). Exits non-zero if any stage failed; the 0.19 stage's output is
# printed after the main suite's.
set -uo pipefail
MAKE=${MAKE:-make}
mk() { "$MAKE" --no-print-directory "$@"; }
t0=$(date +%s)
declare -A took=()
fmt() { printf '%dm%02ds' $(($1 / 60)) $(($1 % 60)); }
report() {
  local total=$(($(date +%s) - t0))
  echo
  echo "make test wall time (2-core budget: 30m00s):"
  printf '  %-36s %s\n' "installs" "${took[installs]:--}" "main suite" "${took[main]:--}" \
    "0.19 stage (beside the main suite)" "${took[m019]:--}" "total" "$(fmt "$total")"
}

start=$(date +%s)
mk -j4 --output-sync=target test-deps
rc=$?
took[installs]=$(fmt $(($(date +%s) - start)))
if ((rc != 0)); then
  report
  exit "$rc"
fi

rm -rf build/test-reports  # an earlier run's: the report is this run's only
log019=$(mktemp "${TMPDIR:-/tmp}/areal-test-mcore019.XXXXXX")
start=$(date +%s)
(mk test-mcore019 >"$log019" 2>&1; echo $? >"$log019.rc"; echo $(($(date +%s) - start)) >"$log019.s") &
pid019=$!
mk test-main
rc_main=$?
took[main]=$(fmt $(($(date +%s) - start)))
wait "$pid019"
rc019=$(cat "$log019.rc")
took[m019]=$(fmt "$(cat "$log019.s")")
echo
echo "=================== megatron-core 0.19 stage (ran beside the main suite) ==================="
cat "$log019"
rm -f "$log019" "$log019.rc" "$log019.s"
report
echo
.venv/bin/python scripts/test_durations.py build/test-reports/*.xml
((rc_main == 0 && rc019 == 0))
