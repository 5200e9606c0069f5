#!/bin/bash
# boba PPO from Qwen3-30B-A3B (configs/qwen3_30b_a3b.yaml) on four 8-GPU nodes: 8 SGLang servers
# of TP 2 on two, a megatron trainer (DP 8 x TP 2, EP 8 carved out of the DP ranks: e adds no
# GPUs) on the other two. Submit from the repo root:
#   sbatch launch/slurm/qwen3_30b_a3b.sh [a.b.c=value ...]
#   sbatch -N 8 launch/slurm/qwen3_30b_a3b.sh   with ALLOC=sglang:d16t2+megatron:d16t2e8 for twice the size
# Command-line sbatch options override the headers below.
#SBATCH --job-name=boba-qwen3-30b-a3b  # name in squeue / sacct
#SBATCH --nodes=4                   # 2 rollout + 2 trainer nodes (must match ALLOC)
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
areal_launch configs/qwen3_30b_a3b.yaml "sglang:d8t2+megatron:d8t2e8" "$@"
