"""Launching runs: the allocation string, Slurm (sbatch + in-allocation launcher), submitit."""
