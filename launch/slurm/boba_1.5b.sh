#!/bin/bash
# boba PPO, 1.5B (configs/boba_1.5b.yaml) on two 8-GPU nodes: 8 SGLang servers on the
# first, an 8-way data-parallel megatron trainer on the second. Submit from the repo root:
#   sbatch launch/slurm/boba_1.5b.sh [a.b.c=value ...]
#   CONFIG=configs/tiny_cpu.yaml ALLOC=embedded:d1+megatron:d1 GPUS_PER_NODE=1 \
#     sbatch -N 2 --gpus-per-node=0 launch/slurm/boba_1.5b.sh      # CPU nodes
# Command-line sbatch options override the headers below.
#SBATCH --job-name=boba-1.5b        # name in squeue / sacct
#SBATCH --nodes=2                   # rollout node + trainer node (must match ALLOC)
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
areal_launch configs/boba_1.5b.yaml "sglang:d8+megatron:d8" "$@"
