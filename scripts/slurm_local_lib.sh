# shellcheck shell=bash
# Shared by slurm_local_up.sh and slurm_local_down.sh (sourced): the cluster's paths and
# the pid-file helpers both use to find its daemons.

# shellcheck disable=SC2034  # used by the scripts that source this file
RUN_DIR=/run/areal-slurm
LOG_DIR=/var/log/slurm-local
MUNGE_PID=/run/munge/munged.pid
MARIADB_PID=/run/mysqld/mysqld.pid

# Alive and not a zombie (a daemon's zombie lingers until its parent reaps it).
alive() {
  local stat
  read -r stat 2>/dev/null <"/proc/$1/stat" || return 1
  stat=${stat##*) }
  [[ ${stat:0:1} != Z ]]
}

pid_of() {
  # pid_of PIDFILE COMM: print the pid recorded in PIDFILE if that process is alive and
  # its command name is COMM (guards against stale files and recycled pids).
  local pid comm
  [[ -r $1 ]] || return 1
  read -r pid 2>/dev/null <"$1" || return 1
  [[ $pid =~ ^[0-9]+$ ]] || return 1
  read -r comm 2>/dev/null <"/proc/$pid/comm" || return 1
  [[ $comm == "$2" ]] || return 1
  alive "$pid" || return 1
  echo "$pid"
}
