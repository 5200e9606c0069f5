"""The ``launch`` section of a run's config: how a Slurm allocation is used."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from areal_mcore.checks import FieldError, check_choice, check_positive, field_error
from areal_mcore.launcher.allocation import AllocationError, parse_allocation

STAGES = ("ppo", "sft")


@dataclass(kw_only=True)
class LaunchConfig:
    # <rollout>:<dims>+megatron:<dims> (launcher/allocation.py); the trainer's tp/pp and the
    # servers' count and tp_size follow it. Its rollout backend must be server.backend;
    # null: one server of server.backend and one trainer GPU (`megatron:d1` for sft).
    allocation: str | None = None
    stage: str = "ppo"  # ppo: servers + `areal-mcore train`; sft: `areal-mcore sft`, trainer only
    gpus_per_node: int = 8  # the embedded backend on CPU nodes: processes per node
    gpus: bool | None = None  # ask srun for GPUs; None: when the rollout backend is sglang
    max_restarts: int = 3  # requeues (time limit, preemption, node failure) before giving up
    server_startup_timeout_s: float = 1800.0
    # The time limit (sbatch sets no --signal the launcher can read, so it reads the job's
    # EndTime): the trainer is asked to checkpoint and stop this long before it, or longer
    # when the slowest recent step (whose time includes a checkpoint save) needs more
    # (1.5x, plus requeue_margin_s); requeue_margin_s before it, a trainer still running
    # is stopped and the job requeued, resuming from the last checkpoint, so that the
    # job never ends as TIMEOUT, which --requeue does not cover. > Slurm's KillWait (30 s).
    stop_lead_s: float = 300.0
    requeue_margin_s: float = 60.0
    # Exported to every step. For GPU-Direct RDMA over InfiniBand/RoCE admins set e.g.
    # NCCL_IB_HCA=mlx5_0,mlx5_1 NCCL_NET_GDR_LEVEL=PHB NCCL_SOCKET_IFNAME=ib0 (or the RoCE
    # netdev) and NCCL_IB_GID_INDEX=3 for RoCE v2. The weight-update group's own settings
    # (net.NCCL_ENV: NCCL_CUMEM_ENABLE=0, NCCL_NVLS_ENABLE=0, as SGLang sets them) are added
    # where this does not set them.
    env: dict[str, str] = field(default_factory=dict)
    srun_args: list[str] = field(default_factory=list)  # added to every srun, e.g. --mpi=none
    # Each srun step's share of its node. Clusters that confine steps with cgroups give a
    # step without --cpus-per-task one CPU, and since Slurm 20.11 a step without explicit
    # resources asks for all of the job's share of the node, so the next step there (a
    # second rollout server) waits for it. Every step therefore asks for its GPUs' share
    # (--exact --cpus-per-task --mem): None = the job's CPUs (SLURM_CPUS_ON_NODE) or memory
    # (SLURM_MEM_PER_NODE, MB) on the node divided by gpus_per_node; a number fixes it
    # (admins: the CPUs and MB one GPU may use); mem_per_gpu_mb=0 leaves --mem out (the
    # cluster's DefMemPerCPU/DefMemPerNode apply).
    cpus_per_gpu: int | None = None
    mem_per_gpu_mb: int | None = None

    def __post_init__(self):
        check_choice("stage", self.stage, STAGES)
        if self.allocation is not None:  # None: ExperimentConfig derives it from server.backend
            try:
                alloc = parse_allocation(self.allocation)  # a malformed string fails at config load
            except AllocationError as e:
                raise FieldError("allocation", f": {e}") from None
            if (alloc.rollout is None) != (self.stage == "sft"):
                raise field_error("allocation", self.allocation, f"does not suit stage={self.stage!r}: ppo needs "
                                  "'<rollout>:<dims>+megatron:<dims>', sft a trainer-only 'megatron:<dims>'")
        check_positive("gpus_per_node", self.gpus_per_node)
        check_positive("max_restarts", self.max_restarts, allow_zero=True)
        check_positive("requeue_margin_s", self.requeue_margin_s)
        if self.stop_lead_s < self.requeue_margin_s:
            raise field_error("stop_lead_s", self.stop_lead_s,
                              f"must be >= requeue_margin_s ({self.requeue_margin_s:g}): the trainer is "
                              "asked to stop before the launcher stops it")
        if self.cpus_per_gpu is not None and self.cpus_per_gpu < 1:
            raise field_error("cpus_per_gpu", self.cpus_per_gpu, "must be >= 1 (or null: an even split)")
        if self.mem_per_gpu_mb is not None and self.mem_per_gpu_mb < 0:
            raise field_error("mem_per_gpu_mb", self.mem_per_gpu_mb, "must be >= 0 (0: no --mem; null: an even split)")

    def step_resources(self, gpus: int, environ: Mapping[str, str]) -> list[str]:
        """srun flags for a task that uses ``gpus`` of its node's ``gpus_per_node`` (on CPU
        nodes: processes), from this section or the job's environment."""
        cpus = self.cpus_per_gpu
        if cpus is None:
            on_node = int(str(environ.get("SLURM_CPUS_ON_NODE", "0")).split("(")[0] or 0)
            cpus = max(1, on_node // self.gpus_per_node) if on_node else None
        mem = self.mem_per_gpu_mb
        if mem is None:
            per_node = int(environ.get("SLURM_MEM_PER_NODE", "0") or 0)
            mem = per_node // self.gpus_per_node if per_node else None
        flags = ["--exact"]
        if cpus:
            flags.append(f"--cpus-per-task={cpus * gpus}")
        if mem:
            flags.append(f"--mem={mem * gpus}M")
        return flags
