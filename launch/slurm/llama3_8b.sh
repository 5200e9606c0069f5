#!/bin/bash
# boba PPO from Llama-3.1-8B-Instruct (configs/llama3_8b.yaml) on four 8-GPU nodes: 16 SGLang servers on two, a
# megatron trainer (DP 8 x TP 2) on the other two. Submit from the repo root:
#   sbatch launch/slurm/llama3_8b.sh [a.b.c=value ...]
#   sbatch -N 8 launch/slurm/llama3_8b.sh   with ALLOC=sglang:d32+megatron:d16t2 for twice the size
# Command-line sbatch options override the headers below.
#SBATCH --job-name=boba-llama3-8b    # name in squeue / sacct
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
areal_launch configs/llama3_8b.yaml "sglang:d16+megatron:d8t2" "$@"
