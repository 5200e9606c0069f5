"""The ``launch`` section of a run's config: how a Slurm allocation is used."""

from __future__ import annotations

from dataclasses import dataclass, field

from areal_mcore.launcher.allocation import parse_allocation

STAGES = ("ppo", "sft")


@dataclass(kw_only=True)
class LaunchConfig:
    # <rollout>:<dims>+megatron:<dims> (launcher/allocation.py); the trainer's tp/pp and the
    # servers' count and tp_size follow it.
    allocation: str = "embedded:d1+megatron:d1"
    stage: str = "ppo"  # ppo: servers + `areal-mcore train`; sft: `areal-mcore sft`, trainer only
    gpus_per_node: int = 8  # the embedded backend on CPU nodes: processes per node
    gpus: bool | None = None  # ask srun for GPUs; None: when the rollout backend is sglang
    max_restarts: int = 3  # requeues (time limit, preemption, node failure) before giving up
    server_startup_timeout_s: float = 1800.0
    # Exported to every step. For GPU-Direct RDMA over InfiniBand/RoCE admins set e.g.
    # NCCL_IB_HCA=mlx5_0,mlx5_1 NCCL_NET_GDR_LEVEL=PHB NCCL_SOCKET_IFNAME=ib0 (or the RoCE
    # netdev) and NCCL_IB_GID_INDEX=3 for RoCE v2. NCCL_CUMEM_ENABLE=0: the weight-update
    # group spans the trainer and SGLang processes, whose cuMem-based buffers cannot be
    # registered across them (SGLang sets the same for its own groups).
    env: dict[str, str] = field(default_factory=lambda: {"NCCL_CUMEM_ENABLE": "0"})
    srun_args: list[str] = field(default_factory=list)  # added to every srun, e.g. --mpi=none

    def __post_init__(self):
        alloc = parse_allocation(self.allocation)  # a malformed string fails at config load
        if self.stage not in STAGES:
            raise ValueError(f"stage={self.stage!r} is not allowed; choose one of {list(STAGES)}")
        if (alloc.rollout is None) != (self.stage == "sft"):
            raise ValueError(f"allocation={self.allocation!r} does not suit stage={self.stage!r}: ppo needs "
                             f"'<rollout>:<dims>+megatron:<dims>', sft a trainer-only 'megatron:<dims>'")
        if self.gpus_per_node < 1 or self.max_restarts < 0:
            raise ValueError("launch.gpus_per_node must be >= 1 and launch.max_restarts >= 0")
