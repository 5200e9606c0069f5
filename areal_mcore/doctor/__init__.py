"""``areal-mcore doctor``: a preflight of the cluster against the run's own shape.

It runs on every node of the allocation before the launcher starts any server (or alone),
and checks what would hang or kill a long job hours in: GPU health (NVML), the software
stack, the fabric (an all-reduce over the trainer's ranks, started as the trainer is), the
network between trainer and rollout nodes, the run directory's filesystem, Slurm's
settings, torchrun variables in the steps' environment, and the memory plan on the GPUs
found. Each check is a row: pass/warn/fail/skip, measured against expected, and what to
do. docs/slurm_admin.md explains each check and its threshold.
"""
