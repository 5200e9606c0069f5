#!/usr/bin/env bash
# `make check-latest` (not in CI): would the newest releases that setup.py's ranges allow break
# a fresh install once the locks are regenerated? Resolves setup.py afresh (torch stays the CPU
# 2.13.0 build the Makefile pins) into a scratch venv, prints what moved against
# locks/main.txt, and runs the fast tier there. Exits non-zero if any test failed.
set -uo pipefail
cd "$(dirname "$0")/.." || exit
UV=${UV:-.venv/bin/uv}
VENV=${LATEST_VENV:-.venv-latest}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "torch==2.13.0+cpu" >"$tmp/torch.txt"
"$UV" pip compile --quiet --upgrade --python-version 3.11 --find-links "${TORCH_LINKS:?}" \
  --constraint "$tmp/torch.txt" --output-file "$tmp/latest.txt" setup.py --extra dev || exit
# name=version, names normalised; uv is the Makefile's installer, not a dependency
pins() {
  grep -oE '^[A-Za-z0-9_.-]+==[^ ]+' "$1" \
    | awk -F'==' '{n = tolower($1); gsub(/[_.]+/, "-", n); if (n != "uv") print n "=" $2}' | sort
}
echo "against locks/main.txt (locked -> newest allowed):"
join -t= -a1 -a2 -e '(none)' -o 0,1.2,2.2 <(pins locks/main.txt) <(pins "$tmp/latest.txt") \
  | awk -F= '$2 != $3 {print "  " $1 ": " $2 " -> " $3; n++} END {if (!n) print "  nothing"}'
test -x "$VENV/bin/python" || python3 -m venv "$VENV"
"$UV" pip sync --quiet --find-links "$TORCH_LINKS" --python "$VENV/bin/python" "$tmp/latest.txt" || exit
"$UV" pip install --quiet --python "$VENV/bin/python" --no-deps -e . || exit
# The fast tier, as `make test-fast` runs it; the lock test would only repeat the list above.
"$VENV/bin/python" -m pytest -q -m "${FAST_TIER:?}" -n 2 -p no:cacheprovider \
  --deselect tests/test_install.py::test_main_venv_holds_exactly_the_locked_versions \
  >"$tmp/pytest.log" 2>&1
rc=$?
echo
echo "fast tier on the newest versions: $(tail -1 "$tmp/pytest.log")"
grep -E '^(FAILED|ERROR) ' "$tmp/pytest.log" | sed 's/^/  /'
exit "$rc"
