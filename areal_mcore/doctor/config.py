"""The ``doctor`` section: what ``areal-mcore doctor`` checks and what the launcher does with it."""

from __future__ import annotations

from dataclasses import dataclass, field

from areal_mcore.checks import check_choice, check_positive, field_error

CHECKS = ("gpu", "stack", "storage", "env", "ports", "network", "fabric", "slurm", "memory")
ON_LAUNCH = ("fail", "warn", "skip")


@dataclass(kw_only=True)
class DoctorConfig:
    # The Slurm launcher runs the doctor before any server: fail stops the job when a check
    # fails (exit 1), warn prints the table and starts anyway, skip does not run it ("off" would
    # read as YAML false).
    on_launch: str = "fail"
    checks: list[str] = field(default_factory=lambda: list(CHECKS))
    allreduce_mb: int = 64  # the fabric check's all-reduce size per rank
    # Bus bandwidth below this warns (GB/s, nccl-tests' busbw); null: by interconnect
    # (docs/slurm_admin.md): NCCL 100 inside a node, 10 across nodes; gloo is not judged.
    min_busbw_gbps: float | None = None
    # Each srun step of the doctor, and the fabric's process group. Python and torch start
    # in each task first: from a cold shared filesystem on many nodes at once that alone
    # can take a minute, and a doctor that times out on it fails a healthy job.
    timeout_s: float = 180.0

    def __post_init__(self):
        check_choice("on_launch", self.on_launch, ON_LAUNCH)
        for name in self.checks:
            if name not in CHECKS:
                raise field_error("checks", self.checks, f"names {name!r}; choose from {list(CHECKS)}")
        check_positive("allreduce_mb", self.allreduce_mb)
        check_positive("timeout_s", self.timeout_s)
