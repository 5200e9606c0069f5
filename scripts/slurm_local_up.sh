#!/usr/bin/env bash
# Start a REAL single-host Slurm cluster on localhost (for CI and local testing of the
# Slurm launcher): Debian slurm-wlm 22.05 + munge + slurmdbd/MariaDB (accounting on, so
# `sacct` works), N virtual nodes (default 2) served by one slurmd each on this host.
# No systemd needed; every daemon is started directly and recorded in a pid file.
#
#   bash scripts/slurm_local_up.sh      # install (apt, only if missing) + start; idempotent
#   bash scripts/slurm_local_down.sh    # stop everything by pid file
#
# Result: cluster "areal", partition "debug" (default, no time limit), nodes node1..nodeN
# (NodeAddr 127.0.0.1, CPUs=2, RealMemory=8000, Gres=gpu:2 backed by /dev/null),
# config in /etc/slurm (Debian's default, so sinfo/sbatch/sacct need no env vars),
# state in /var/lib/areal-slurm, pid files in /run/areal-slurm,
# logs in /var/log/slurm-local.
#
# Knobs (environment): AREAL_SLURM_NODES (2), AREAL_SLURM_CPUS (2 per node),
# AREAL_SLURM_MEM_MB (8000 per node), AREAL_SLURM_FAKE_GPUS (2 per node; 0 = no gres),
# AREAL_SLURM_TIMEOUT (60 s per wait).
# Exits 0 when the cluster is up (immediately if it already was), non-zero with the
# failing component named and the relevant log tails printed otherwise.
set -euo pipefail

CLUSTER=areal
PARTITION=debug
NNODES=${AREAL_SLURM_NODES:-2}
CPUS=${AREAL_SLURM_CPUS:-2}
MEM_MB=${AREAL_SLURM_MEM_MB:-8000}
FAKE_GPUS=${AREAL_SLURM_FAKE_GPUS:-2}
WAIT_S=${AREAL_SLURM_TIMEOUT:-60}

# Paths (keep in sync with slurm_local_down.sh).
# shellcheck source=scripts/slurm_local_lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/slurm_local_lib.sh"
CONF_DIR=/etc/slurm
STATE_DIR=/var/lib/areal-slurm
MARIADB_SOCK=/run/mysqld/mysqld.sock
CTLD_PORT=6817
DBD_PORT=6819
NODE_PORT0=6820 # node i listens on NODE_PORT0 + i
DB_NAME=slurm_acct_db
DB_USER=slurm
DB_PASS=areal-slurm-local # local socket only (MariaDB runs with --skip-networking)
MARKER="# Managed by areal-mcore scripts/slurm_local_up.sh: local edits are overwritten."
PKGS=(munge mariadb-server slurmctld slurmd slurmdbd slurm-client)

T0=$(date +%s.%N)
log() { printf '[slurm-local] %s\n' "$*"; }
elapsed() { awk -v a="$T0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }

tail_logs() {
  local f
  for f in "$@"; do
    [[ -s $f ]] || continue
    printf '\n----- last lines of %s -----\n' "$f" >&2
    tail -n 25 "$f" >&2 || true
  done
}

die() {
  # die MESSAGE [LOG...]: explain what failed, show the logs that tell why, exit 1.
  local msg=$1
  shift
  printf '\n[slurm-local] ERROR: %s\n' "$msg" >&2
  tail_logs "$@"
  printf '\n[slurm-local] all logs: %s/\n' "$LOG_DIR" >&2
  exit 1
}

if [[ $EUID -ne 0 ]]; then
  if command -v sudo >/dev/null 2>&1; then
    exec sudo -E bash "$0" "$@"
  fi
  die "must run as root (installs packages and starts system daemons)"
fi

# One up/down at a time (e.g. parallel CI steps); a second caller waits, then sees "up".
# (flock -o: the daemons started below must not inherit the lock.)
if [[ -z ${AREAL_SLURM_LOCKED:-} ]]; then
  install -d -m 0755 "$RUN_DIR"
  AREAL_SLURM_LOCKED=1 exec flock -o -w 600 "$RUN_DIR/lock" bash "$0" "$@"
fi
unset AREAL_SLURM_LOCKED

[[ $NNODES =~ ^[1-9][0-9]?$ ]] || die "AREAL_SLURM_NODES must be 1..99, got '$NNODES'"
[[ $CPUS =~ ^[1-9][0-9]*$ ]] || die "AREAL_SLURM_CPUS must be a positive integer, got '$CPUS'"
[[ $MEM_MB =~ ^[1-9][0-9]*$ ]] || die "AREAL_SLURM_MEM_MB must be a positive integer, got '$MEM_MB'"
[[ $FAKE_GPUS =~ ^[0-9]$ ]] || die "AREAL_SLURM_FAKE_GPUS must be 0..9, got '$FAKE_GPUS'"

HOST=$(hostname -s)
NODES=()
for ((i = 1; i <= NNODES; i++)); do NODES+=("node$i"); done
if ((NNODES == 1)); then NODELIST=node1; else NODELIST="node[1-$NNODES]"; fi

# ---------------------------------------------------------------- process helpers
wait_for() {
  # wait_for SECONDS COMMAND...: poll COMMAND every 0.25 s until it succeeds.
  local deadline
  deadline=$(($(date +%s) + $1))
  shift
  until "$@" >/dev/null 2>&1; do
    (($(date +%s) < deadline)) || return 1
    sleep 0.25
  done
}

not_alive() { ! alive "$1"; }

await_daemon() {
  # await_daemon CHECK PIDFILE COMM LOG...: poll CHECK for up to WAIT_S seconds; die
  # early if the daemon exits meanwhile (after 3 s of grace to write its pid file).
  local check=$1 pidfile=$2 comm=$3 start now
  shift 3
  start=$(date +%s)
  until "$check" >/dev/null 2>&1; do
    now=$(date +%s)
    ((now < start + WAIT_S)) || die "$comm did not come up within $WAIT_S s ($check failed)" "$@"
    if ((now >= start + 3)) && ! pid_of "$pidfile" "$comm" >/dev/null && ! "$check" >/dev/null 2>&1; then
      die "$comm exited during startup (not running per $pidfile)" "$@"
    fi
    sleep 0.25
  done
}

stop_pidfile() {
  # stop_pidfile PIDFILE COMM: SIGTERM, wait up to 20 s, then SIGKILL.
  local pid
  pid=$(pid_of "$1" "$2") || return 0
  log "stopping $2 (pid $pid)"
  kill -TERM "$pid" 2>/dev/null || true
  if ! wait_for 20 not_alive "$pid"; then kill -KILL "$pid" 2>/dev/null || true; fi
  rm -f "$1"
}

# ---------------------------------------------------------------- config files
gen_slurm_conf() {
  local i gres=""
  ((FAKE_GPUS > 0)) && gres=" Gres=gpu:$FAKE_GPUS"
  cat <<EOF
$MARKER
# Single-host test cluster: $NNODES virtual nodes, each its own slurmd (slurmd -N nodeI).
ClusterName=$CLUSTER
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# Short credential lifetime: a requeued job otherwise waits ~120 s before it may restart.
AuthInfo=cred_expire=10
StateSaveLocation=$STATE_DIR/slurmctld
SlurmdSpoolDir=$STATE_DIR/slurmd-%n
SlurmctldPidFile=$RUN_DIR/slurmctld.pid
SlurmdPidFile=$RUN_DIR/slurmd-%n.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups (containers, CI VMs): track job processes by parentage, no task binding.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
# Node CPUs/memory come from this file, not from the (shared) hardware.
SlurmdParameters=config_overrides
ReturnToService=2
MailProg=/bin/true
JobRequeue=1
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=2,batch_sched_delay=0
# Cores are the consumable: several small jobs/steps share a node; memory is not tracked.
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$DBD_PORT
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=30
JobCompType=jobcomp/none
InactiveLimit=0
MinJobAge=300
EOF
  ((FAKE_GPUS > 0)) && echo "GresTypes=gpu"
  for ((i = 1; i <= NNODES; i++)); do
    echo "NodeName=node$i NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$((NODE_PORT0 + i)) CPUs=$CPUS RealMemory=$MEM_MB$gres State=UNKNOWN"
  done
  echo "PartitionName=$PARTITION Nodes=$NODELIST Default=YES MaxTime=INFINITE State=UP"
}

gen_gres_conf() {
  echo "$MARKER"
  echo "# Fake GPUs: gres File= must be character devices; symlinks to /dev/null do."
  ((FAKE_GPUS > 0)) && echo "NodeName=$NODELIST Name=gpu File=/dev/areal_fake_gpu[0-$((FAKE_GPUS - 1))]"
  return 0
}

gen_slurmdbd_conf() {
  cat <<EOF
$MARKER
AuthType=auth/munge
DbdHost=$HOST
DbdAddr=127.0.0.1
DbdPort=$DBD_PORT
SlurmUser=root
LogFile=$LOG_DIR/slurmdbd.log
PidFile=$RUN_DIR/slurmdbd.pid
DebugLevel=info
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=$DB_USER
StoragePass=$DB_PASS
StorageLoc=$DB_NAME
EOF
}

CONF_CHANGED=0
install_conf() {
  # install_conf PATH MODE CONTENT: write only when the content differs; back up a file
  # that this script did not write.
  local path=$1 mode=$2 content=$3
  if [[ -f $path ]] && [[ "$(cat "$path")" == "$content" ]]; then
    chmod "$mode" "$path"
    return 0
  fi
  if [[ -f $path ]] && ! grep -qF "$MARKER" "$path"; then
    cp -p "$path" "$path.bak.$(date +%Y%m%d%H%M%S)"
    log "backed up existing $path"
  fi
  install -d -m 0755 "$(dirname "$path")"
  printf '%s\n' "$content" >"$path.tmp"
  chmod "$mode" "$path.tmp"
  mv -f "$path.tmp" "$path"
  CONF_CHANGED=1
}

configs_current() {
  [[ -f $CONF_DIR/slurm.conf && -f $CONF_DIR/slurmdbd.conf && -f $CONF_DIR/gres.conf ]] &&
    [[ "$(cat "$CONF_DIR/slurm.conf")" == "$(gen_slurm_conf)" ]] &&
    [[ "$(cat "$CONF_DIR/slurmdbd.conf")" == "$(gen_slurmdbd_conf)" ]] &&
    [[ "$(cat "$CONF_DIR/gres.conf")" == "$(gen_gres_conf)" ]]
}

# ---------------------------------------------------------------- health checks
munge_ok() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }
mariadb_ok() { mariadb-admin --socket="$MARIADB_SOCK" ping >/dev/null 2>&1; }
dbd_ok() { timeout 10 sacctmgr -n -P list cluster format=cluster >/dev/null 2>&1; }
ctld_ok() { timeout 10 scontrol ping 2>/dev/null | grep -q 'is UP'; }

nodes_ready() {
  # All nodes respond (no '*' suffix) and are usable (idle/mixed/allocated/completing).
  local out n st
  out=$(timeout 10 sinfo -h -N -p "$PARTITION" -o '%N %t' 2>/dev/null) || return 1
  for n in "${NODES[@]}"; do
    st=$(awk -v n="$n" '$1 == n { print $2 }' <<<"$out")
    case $st in
      idle | mix | alloc | comp) ;;
      *) return 1 ;;
    esac
  done
}

cluster_up() {
  command -v scontrol >/dev/null 2>&1 && command -v sacctmgr >/dev/null 2>&1 || return 1
  configs_current || return 1
  pid_of "$RUN_DIR/slurmctld.pid" slurmctld >/dev/null || return 1
  pid_of "$RUN_DIR/slurmdbd.pid" slurmdbd >/dev/null || return 1
  local n
  for n in "${NODES[@]}"; do pid_of "$RUN_DIR/slurmd-$n.pid" slurmd >/dev/null || return 1; done
  ctld_ok && nodes_ready && dbd_ok
}

print_usage_summary() {
  log "cluster '$CLUSTER' is up ($1 in $(elapsed) s): partition '$PARTITION' (default), nodes $NODELIST"
  log "config $CONF_DIR/slurm.conf, state $STATE_DIR, logs $LOG_DIR/, stop with scripts/slurm_local_down.sh"
  sinfo -N -o '%N %P %t %c %m %G' 2>/dev/null | sed 's/^/[slurm-local]   /' || true
}

# ---------------------------------------------------------------- fast path
if cluster_up; then
  print_usage_summary "already running"
  exit 0
fi

install -d -m 0755 "$LOG_DIR" "$RUN_DIR" "$STATE_DIR"

# ---------------------------------------------------------------- install (apt)
install_packages() {
  local p missing=() policy=/usr/sbin/policy-rc.d t
  for p in "${PKGS[@]}"; do
    [[ $(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null) == installed ]] || missing+=("$p")
  done
  ((${#missing[@]} == 0)) && return 0
  command -v apt-get >/dev/null 2>&1 || die "missing packages (${missing[*]}) and no apt-get to install them"
  log "installing ${missing[*]} with apt-get (log: $LOG_DIR/apt.log)"
  t=$(date +%s)
  # Keep package scripts from starting daemons themselves (there is no init system to
  # manage them; this script starts everything below).
  if [[ ! -e $policy ]]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy"
    chmod 0755 "$policy"
    ADDED_POLICY=$policy
  fi
  export DEBIAN_FRONTEND=noninteractive
  local ok=0
  if apt-get install -y -q --no-install-recommends "${missing[@]}" >>"$LOG_DIR/apt.log" 2>&1; then
    ok=1
  else
    log "apt-get install failed; running apt-get update and retrying"
    if apt-get update -q >>"$LOG_DIR/apt.log" 2>&1 &&
      apt-get install -y -q --no-install-recommends "${missing[@]}" >>"$LOG_DIR/apt.log" 2>&1; then
      ok=1
    fi
  fi
  if [[ -n $ADDED_POLICY ]]; then
    rm -f "$ADDED_POLICY"
    ADDED_POLICY=""
  fi
  ((ok)) || die "apt-get install ${missing[*]} failed" "$LOG_DIR/apt.log"
  log "installed in $(($(date +%s) - t)) s"
}
ADDED_POLICY=""
trap '[[ -z $ADDED_POLICY ]] || rm -f "$ADDED_POLICY"' EXIT
install_packages

# ---------------------------------------------------------------- configs
install_conf "$CONF_DIR/slurm.conf" 0644 "$(gen_slurm_conf)"
install_conf "$CONF_DIR/gres.conf" 0644 "$(gen_gres_conf)"
install_conf "$CONF_DIR/slurmdbd.conf" 0600 "$(gen_slurmdbd_conf)"
if ((CONF_CHANGED)); then
  # Daemons still running with an older configuration are restarted below.
  log "configuration written to $CONF_DIR"
  for f in "$RUN_DIR"/slurmd-*.pid; do
    [[ -e $f ]] && stop_pidfile "$f" slurmd
  done
  stop_pidfile "$RUN_DIR/slurmctld.pid" slurmctld
  stop_pidfile "$RUN_DIR/slurmdbd.pid" slurmdbd
fi

install -d -m 0755 "$STATE_DIR/slurmctld"
for n in "${NODES[@]}"; do install -d -m 0755 "$STATE_DIR/slurmd-$n"; done
for ((g = 0; g < FAKE_GPUS; g++)); do ln -sfn /dev/null "/dev/areal_fake_gpu$g"; done

# Node names must resolve (launchers use them as host names, e.g. a master address).
missing_hosts=()
for n in "${NODES[@]}"; do getent hosts "$n" >/dev/null 2>&1 || missing_hosts+=("$n"); done
if ((${#missing_hosts[@]})); then
  echo "127.0.0.1 ${missing_hosts[*]} # areal-slurm-local virtual nodes" >>/etc/hosts
  log "added ${missing_hosts[*]} -> 127.0.0.1 to /etc/hosts"
fi

# ---------------------------------------------------------------- munge
if ! munge_ok; then
  if ! pid_of "$MUNGE_PID" munged >/dev/null; then
    if [[ ! -s /etc/munge/munge.key ]]; then
      log "creating /etc/munge/munge.key"
      mungekey --create --force >/dev/null 2>&1 ||
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
    fi
    chown munge:munge /etc/munge/munge.key
    chmod 0400 /etc/munge/munge.key
    install -d -o munge -g munge -m 0755 /run/munge
    install -d -o munge -g munge -m 0700 /var/lib/munge
    install -d -o munge -g munge -m 0700 "$LOG_DIR/munge"
    log "starting munged"
    runuser -u munge -- /usr/sbin/munged --pid-file="$MUNGE_PID" \
      --log-file="$LOG_DIR/munge/munged.log" >>"$LOG_DIR/munge/munged.start.log" 2>&1 ||
      die "munged failed to start" "$LOG_DIR/munge/munged.start.log" "$LOG_DIR/munge/munged.log"
  fi
  wait_for 10 munge_ok || die "munge does not answer (munge -n | unmunge)" \
    "$LOG_DIR/munge/munged.start.log" "$LOG_DIR/munge/munged.log"
fi

# ---------------------------------------------------------------- MariaDB
if ! mariadb_ok; then
  if ! pid_of "$MARIADB_PID" mariadbd >/dev/null; then
    if [[ ! -d /var/lib/mysql/mysql ]]; then
      log "initialising MariaDB data directory"
      mariadb-install-db --user=mysql --datadir=/var/lib/mysql --skip-test-db \
        --auth-root-authentication-method=socket >>"$LOG_DIR/mariadb.log" 2>&1 ||
        die "mariadb-install-db failed" "$LOG_DIR/mariadb.log"
    fi
    install -d -o mysql -g mysql -m 0755 /run/mysqld
    touch "$LOG_DIR/mariadb.log"
    chown mysql:mysql "$LOG_DIR/mariadb.log"
    log "starting MariaDB"
    setsid /usr/sbin/mariadbd --user=mysql --skip-networking --socket="$MARIADB_SOCK" \
      --pid-file="$MARIADB_PID" --log-error="$LOG_DIR/mariadb.log" \
      --innodb-lock-wait-timeout=900 \
      </dev/null >>"$LOG_DIR/mariadb.log" 2>&1 &
  fi
  await_daemon mariadb_ok "$MARIADB_PID" mariadbd "$LOG_DIR/mariadb.log"
fi
mariadb --socket="$MARIADB_SOCK" -e "
  CREATE DATABASE IF NOT EXISTS $DB_NAME;
  CREATE USER IF NOT EXISTS '$DB_USER'@'localhost' IDENTIFIED BY '$DB_PASS';
  ALTER USER '$DB_USER'@'localhost' IDENTIFIED BY '$DB_PASS';
  GRANT ALL PRIVILEGES ON $DB_NAME.* TO '$DB_USER'@'localhost';" >>"$LOG_DIR/mariadb.log" 2>&1 ||
  die "could not create the accounting database/user in MariaDB" "$LOG_DIR/mariadb.log"

# ---------------------------------------------------------------- slurmdbd
if ! pid_of "$RUN_DIR/slurmdbd.pid" slurmdbd >/dev/null; then
  log "starting slurmdbd"
  slurmdbd >>"$LOG_DIR/slurmdbd.start.log" 2>&1 ||
    die "slurmdbd failed to start" "$LOG_DIR/slurmdbd.start.log" "$LOG_DIR/slurmdbd.log"
fi
await_daemon dbd_ok "$RUN_DIR/slurmdbd.pid" slurmdbd \
  "$LOG_DIR/slurmdbd.start.log" "$LOG_DIR/slurmdbd.log" "$LOG_DIR/mariadb.log"
if ! sacctmgr -n -P list cluster format=cluster 2>/dev/null | grep -qx "$CLUSTER"; then
  log "registering cluster '$CLUSTER' in slurmdbd"
  sacctmgr -i add cluster "$CLUSTER" >>"$LOG_DIR/slurmdbd.start.log" 2>&1 ||
    die "sacctmgr add cluster $CLUSTER failed" "$LOG_DIR/slurmdbd.start.log" "$LOG_DIR/slurmdbd.log"
fi

# ---------------------------------------------------------------- slurmctld
if ! pid_of "$RUN_DIR/slurmctld.pid" slurmctld >/dev/null; then
  log "starting slurmctld"
  slurmctld >>"$LOG_DIR/slurmctld.start.log" 2>&1 ||
    die "slurmctld failed to start" "$LOG_DIR/slurmctld.start.log" "$LOG_DIR/slurmctld.log"
fi
await_daemon ctld_ok "$RUN_DIR/slurmctld.pid" slurmctld \
  "$LOG_DIR/slurmctld.start.log" "$LOG_DIR/slurmctld.log"

# ---------------------------------------------------------------- slurmd (one per node)
for n in "${NODES[@]}"; do
  if ! pid_of "$RUN_DIR/slurmd-$n.pid" slurmd >/dev/null; then
    log "starting slurmd for $n"
    slurmd -N "$n" >>"$LOG_DIR/slurmd-$n.start.log" 2>&1 ||
      die "slurmd for $n failed to start" "$LOG_DIR/slurmd-$n.start.log" "$LOG_DIR/slurmd-$n.log"
  fi
done

# Nodes left DOWN/DRAINED by an earlier run (e.g. killed mid-job) are resumed once
# their slurmd responds; ReturnToService=2 handles the plain "not responding" case.
resume_stuck_nodes() {
  local n st
  while read -r n st; do
    case $st in
      down | drain | drng | drained | fail | failg)
        scontrol update NodeName="$n" State=RESUME >/dev/null 2>&1 || true
        ;;
    esac
  done < <(timeout 10 sinfo -h -N -r -p "$PARTITION" -o '%N %t' 2>/dev/null)
  nodes_ready
}
nodes_t0=$(date +%s)
deadline=$((nodes_t0 + WAIT_S))
until nodes_ready; do
  if (($(date +%s) >= deadline)); then
    node_logs=()
    for n in "${NODES[@]}"; do node_logs+=("$LOG_DIR/slurmd-$n.start.log" "$LOG_DIR/slurmd-$n.log"); done
    sinfo -N -o '%N %t %E' >&2 || true
    die "nodes did not become idle within $WAIT_S s (sinfo above)" "$LOG_DIR/slurmctld.log" "${node_logs[@]}"
  fi
  for n in "${NODES[@]}"; do
    (($(date +%s) < nodes_t0 + 3)) || pid_of "$RUN_DIR/slurmd-$n.pid" slurmd >/dev/null ||
      die "slurmd for $n exited during startup" "$LOG_DIR/slurmd-$n.start.log" "$LOG_DIR/slurmd-$n.log"
  done
  sleep 0.5
  resume_stuck_nodes >/dev/null 2>&1 || true
done

cluster_up || die "cluster came up but the final health check failed" \
  "$LOG_DIR/slurmctld.log" "$LOG_DIR/slurmdbd.log"
print_usage_summary "started"
