# shellcheck shell=bash
# Shared by launch/slurm/boba_*.sh (sourced inside the batch job). Not a job script.
#
# Environment (all optional):
#   CONFIG         the run's YAML (default: the recipe's)
#   ALLOC          <rollout>:<dims>+megatron:<dims> (default: the recipe's; see
#                  areal_mcore/launcher/allocation.py)
#   GPUS_PER_NODE  GPUs per node (default 8); 1 for CPU nodes running the embedded server
#   PY             the Python with areal-mcore installed (default .venv/bin/python, else python3)
# Extra arguments of sbatch's script are config overrides (a.b.c=value).

areal_launch() {
  local default_config=$1 default_alloc=$2
  shift 2
  # Slurm runs a spooled copy of the script: work from the submission directory.
  cd "${SLURM_SUBMIT_DIR:-.}" || exit 1
  if [ ! -f setup.py ] || [ ! -d areal_mcore ]; then
    echo "[sbatch] submit from the areal-mcore repository root (cwd was $PWD)" >&2
    exit 2
  fi
  local config=${CONFIG:-$default_config} alloc=${ALLOC:-$default_alloc}
  local py=${PY:-.venv/bin/python}
  [ -x "$py" ] || py=python3
  echo "[sbatch] job ${SLURM_JOB_ID:-?} try ${SLURM_RESTART_COUNT:-0} on ${SLURM_JOB_NODELIST:-?}:" \
    "config=$config allocation=$alloc gpus_per_node=${GPUS_PER_NODE:-8}"
  # exec: the launcher itself gets the time-limit signal (--signal=B:USR2@300).
  exec "$py" -m areal_mcore.launcher.slurm run --config "$config" \
    "launch.allocation=$alloc" "launch.gpus_per_node=${GPUS_PER_NODE:-8}" "$@"
}
