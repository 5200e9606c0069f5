#!/bin/bash
# boba 32B. Default: the SFT-200 recipe (configs/boba_32b_sft.yaml) on 4 nodes, one
# megatron replica of PP 4 x TP 8. STAGE=ppo: boba PPO on the SFT model
# (configs/boba_32b_ppo.yaml); the allocation defaults to half the nodes for SGLang
# servers of TP 4 and half for trainer replicas of PP 4 x TP 8, so N must be a multiple
# of 8, up to 128 nodes:
#   sbatch launch/slurm/boba_32b.sh
#   STAGE=ppo sbatch -N 128 launch/slurm/boba_32b.sh    # sglang:d128t4+megatron:d16p4t8
# Command-line sbatch options override the headers below.
#SBATCH --job-name=boba-32b         # name in squeue / sacct
#SBATCH --nodes=4                   # SFT: one 32-GPU replica (STAGE=ppo: up to 128)
#SBATCH --ntasks-per-node=1         # the launcher starts its own srun steps
#SBATCH --gpus-per-node=8           # whole 8-GPU nodes
#SBATCH --exclusive                 # no other job on these nodes (NCCL, memory)
#SBATCH --mem=0                     # all of each node's memory (--exclusive grants CPUs, not memory)
#SBATCH --time=72:00:00             # a try's limit; the job requeues itself past it
#SBATCH --requeue                   # allow requeue: time limit, preemption, node failure
#SBATCH --signal=B:USR2@300         # 5 min before the limit: checkpoint, then requeue
#SBATCH --open-mode=append          # every try appends to the same log
#SBATCH --output=slurm-%x-%j.out    # one log per job id, in the submission directory
set -euo pipefail
# shellcheck source=launch/slurm/_common.sh
source "${SLURM_SUBMIT_DIR:-.}/launch/slurm/_common.sh"
nodes=${SLURM_NNODES:-4}
case "${STAGE:-sft}" in
  sft) areal_launch configs/boba_32b_sft.yaml "megatron:d$((nodes / 4))p4t8" launch.stage=sft "$@" ;;
  ppo)
    # Half the nodes serve (2 SGLang TP-4 servers a node), half train (4-node PP4 x TP8
    # replicas): N = 8, 16, ..., 128. The header's -N 4 is the SFT layout.
    if ((nodes < 8 || nodes % 8 || nodes > 128)) && [ -z "${ALLOC:-}" ]; then
      echo "[sbatch] STAGE=ppo needs -N a multiple of 8 from 8 to 128 (half the nodes for SGLang TP-4" \
        "servers, half for 4-node PP4 x TP8 trainer replicas), e.g. STAGE=ppo sbatch -N 16" \
        "launch/slurm/boba_32b.sh; this job has ${nodes} nodes (or set ALLOC)" >&2
      exit 2
    fi
    areal_launch configs/boba_32b_ppo.yaml "sglang:d${nodes}t4+megatron:d$((nodes / 8))p4t8" "$@" ;;
  *) echo "[sbatch] STAGE=${STAGE} is not one of: sft, ppo" >&2; exit 2 ;;
esac
