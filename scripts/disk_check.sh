#!/usr/bin/env bash
# Refuses to start an install (or the suite) that would run out of disk half-way: a full
# disk stops pip minutes in, with a venv half-written (seen: `make test` died after 7 min
# installing .venv-mcore019, "[Errno 28] No space left on device").
#
# usage: disk_check.sh WHAT:MARKER:GB ...
#   WHAT    what needs the space (named in the error)
#   MARKER  a path that exists once WHAT is there (then it needs nothing); '-': always
#   GB      its size on disk (measured, rounded up: see the Makefile)
# Each WHAT is charged to the filesystem that holds MARKER's directory.
# DISK_CHECK=0 skips the check.
set -euo pipefail
[[ "${DISK_CHECK:-1}" == 0 ]] && exit 0

declare -A need_kb=() names=() mount_of=()
for item in "$@"; do
  IFS=: read -r what marker gb <<<"$item"
  if [[ "$marker" != - ]] && compgen -G "$marker" >/dev/null; then
    continue
  fi
  dir=$(dirname "${marker/#-/.}")
  while [[ ! -d "$dir" ]]; do dir=$(dirname "$dir"); done
  fs=$(df -Pk "$dir" | awk 'NR==2 {print $6}')
  mount_of[$fs]=$dir
  kb=$(awk -v g="$gb" 'BEGIN {printf "%d", g * 1024 * 1024}')
  need_kb[$fs]=$(( ${need_kb[$fs]:-0} + kb ))
  names[$fs]="${names[$fs]:+${names[$fs]}, }$what ${gb} GB"
done

status=0
for fs in "${!need_kb[@]}"; do
  avail=$(df -Pk "${mount_of[$fs]}" | awk 'NR==2 {print $4}')
  if (( avail < need_kb[$fs] )); then
    printf 'disk_check: %s has %.1f GB free; this needs about %.1f GB there (%s).\n' \
      "$fs" "$(awk -v k="$avail" 'BEGIN {print k / 1048576}')" \
      "$(awk -v k="${need_kb[$fs]}" 'BEGIN {print k / 1048576}')" "${names[$fs]}" >&2
    status=1
  fi
done
if (( status )); then
  echo "disk_check: free space first (other clones' venvs: \`make clean\` there), or skip this check with DISK_CHECK=0." >&2
fi
exit "$status"
