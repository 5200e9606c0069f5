#!/usr/bin/env bash
# Stop the single-host Slurm cluster started by scripts/slurm_local_up.sh.
#
# Jobs still queued or running are cancelled first (so no job processes outlive their
# slurmd), then the daemons are stopped in reverse start order -- slurmd (one per
# virtual node), slurmctld, slurmdbd, MariaDB, munged -- each by the pid in its pid
# file (and only if that pid really is the expected daemon): SIGTERM, then SIGKILL
# after a grace period. Configuration, job state and the accounting database are
# kept, so the next `slurm_local_up.sh` continues job ids and sacct history.
# Idempotent: exits 0 at once when nothing is running.
set -euo pipefail

# shellcheck source=scripts/slurm_local_lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/slurm_local_lib.sh"
JOB_DRAIN_S=${AREAL_SLURM_DOWN_JOB_WAIT:-40} # > KillWait (30 s) so jobs can clean up

log() { printf '[slurm-local] %s\n' "$*"; }

if [[ $EUID -ne 0 ]]; then
  if command -v sudo >/dev/null 2>&1; then
    exec sudo -E bash "$0" "$@"
  fi
  echo "[slurm-local] ERROR: must run as root" >&2
  exit 1
fi

# Serialise with slurm_local_up.sh.
# (flock -o: the daemons started below must not inherit the lock.)
if [[ -z ${AREAL_SLURM_LOCKED:-} ]]; then
  install -d -m 0755 "$RUN_DIR"
  AREAL_SLURM_LOCKED=1 exec flock -o -w 600 "$RUN_DIR/lock" bash "$0" "$@"
fi
unset AREAL_SLURM_LOCKED

FAILED=()
stop_group() {
  # stop_group GRACE_S PIDFILE:COMM...: SIGTERM every live daemon named by its pid file
  # at once, wait up to GRACE_S for all to exit, then SIGKILL the rest.
  local grace=$1 spec pid pids=() names=() i left
  shift
  for spec in "$@"; do
    if pid=$(pid_of "${spec%%:*}" "${spec##*:}"); then
      log "stopping ${spec##*:} (pid $pid, from ${spec%%:*})"
      kill -TERM "$pid" 2>/dev/null && pids+=("$pid") && names+=("${spec##*:}")
    fi
  done
  for ((i = 0; i < grace * 10; i++)); do
    left=0
    for pid in "${pids[@]}"; do alive "$pid" && left=1; done
    ((left)) || break
    sleep 0.1
  done
  for i in "${!pids[@]}"; do
    alive "${pids[$i]}" || continue
    log "${names[$i]} (pid ${pids[$i]}) ignored SIGTERM for $grace s; sending SIGKILL"
    kill -KILL "${pids[$i]}" 2>/dev/null || true
    sleep 1
    alive "${pids[$i]}" && FAILED+=("${names[$i]} (pid ${pids[$i]})")
  done
  for spec in "$@"; do rm -f "${spec%%:*}"; done
}

# "pid comm" for every process, read from /proc with builtins only (fast, no procps).
proc_table() {
  local d c
  for d in /proc/[0-9]*; do
    read -r c 2>/dev/null <"$d/comm" && echo "${d#/proc/} $c"
  done
  return 0
}

# Processes named NAME.
pids_named() { proc_table | awk -v n="$1" '$2 == n { print $1 }'; }

# PID and all its descendants.
process_tree() {
  local d line
  for d in /proc/[0-9]*; do
    read -r line 2>/dev/null <"$d/stat" || continue
    line=${line##*) } # fields after "pid (comm) ": state ppid ...
    echo "${d#/proc/} ${line#* }"
  done | awk -v root="$1" '
    { split($2, f, " "); kids[f[1]] = kids[f[1]] " " $1 }
    END {
      n = 1; q[1] = root
      for (i = 1; i <= n; i++) {
        print q[i]; m = split(kids[q[i]], k, " ")
        for (j = 1; j <= m; j++) q[++n] = k[j]
      }
    }'
}

# ---------------------------------------------------------------- jobs
ctld_pid=""
ctld_pid=$(pid_of "$RUN_DIR/slurmctld.pid" slurmctld) || true
if [[ -n $ctld_pid ]] && timeout 10 scontrol ping 2>/dev/null | grep -q 'is UP'; then
  mapfile -t jobs < <(timeout 10 squeue -h -o '%A' 2>/dev/null || true)
  if ((${#jobs[@]})); then
    log "cancelling ${#jobs[@]} job(s): ${jobs[*]}"
    scancel "${jobs[@]}" 2>/dev/null || true
    deadline=$(($(date +%s) + JOB_DRAIN_S))
    while [[ -n "$(timeout 10 squeue -h -o '%A' 2>/dev/null || true)" ]] &&
      (($(date +%s) < deadline)); do
      sleep 0.5
    done
  fi
fi

# ---------------------------------------------------------------- daemons
slurmds=()
for f in "$RUN_DIR"/slurmd-*.pid; do
  [[ -e $f ]] && slurmds+=("$f:slurmd")
done
((${#slurmds[@]} == 0)) || stop_group 20 "${slurmds[@]}"
stop_group 30 "$RUN_DIR/slurmctld.pid:slurmctld" # saves job state, tells slurmdbd
stop_group 30 "$RUN_DIR/slurmdbd.pid:slurmdbd"

# Job steps whose slurmd is gone (e.g. jobs that ignored SIGTERM/SIGKILL above or a
# slurmd that was killed earlier): slurmstepd and its whole process tree.
for p in $(pids_named slurmstepd); do
  mapfile -t tree < <(process_tree "$p")
  log "killing leftover slurmstepd $p and its processes: ${tree[*]}"
  kill -KILL "${tree[@]}" 2>/dev/null || true
done

stop_group 60 "$MARIADB_PID:mariadbd" "$MUNGE_PID:munged"

# ---------------------------------------------------------------- verify
left=()
while read -r p name; do
  alive "$p" && left+=("$name:$p")
done < <(proc_table | awk '$2 ~ /^(slurmd|slurmctld|slurmdbd|slurmstepd|mariadbd|munged)$/')
if ((${#FAILED[@]})); then
  echo "[slurm-local] ERROR: could not stop ${FAILED[*]}; logs in $LOG_DIR/" >&2
  exit 1
fi
if ((${#left[@]})); then
  # Not started by slurm_local_up.sh (no matching pid file): left alone on purpose.
  echo "[slurm-local] WARNING: still running, not started by slurm_local_up.sh (no pid file): ${left[*]}" >&2
  exit 1
fi
log "local Slurm cluster stopped (no slurm/munge/mariadb daemons left)"
