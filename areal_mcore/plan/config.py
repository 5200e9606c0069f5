"""The ``plan`` section: what the memory planner assumes about the GPUs."""

from __future__ import annotations

from dataclasses import dataclass

from areal_mcore.checks import check_positive, field_error

# Usable device memory as the CUDA runtime reports it (torch.cuda.get_device_properties).
GPUS_GB = {"h100": 79.6, "h200": 139.8, "a100": 79.3, "a100-40gb": 39.4}


@dataclass(kw_only=True)
class PlanConfig:
    """``areal-mcore plan`` and the check that train/sft/the Slurm launcher run first."""

    # Refuse to start a config the planner says does not fit (``--no-plan-check`` sets false).
    check: bool = True
    gpu_memory_gb: float = 79.6  # per GPU, trainer and rollout servers (an 80 GB H100)
    # Kept free on every trainer GPU: CUDA context and NCCL buffers (~1-2 GB), allocator
    # fragmentation of long variable-length micro-batches.
    margin_gb: float = 5.0
    # The architecture when model_path has no config.json yet (e.g. an SFT output): a name
    # from plan/architectures.py, e.g. DeepSeek-R1-Distill-Qwen-32B.
    architecture: str | None = None
    # Response lengths the rollout concurrency is sized from (plan/concurrency.py): None,
    # the boba default (plan/lengths.py); else a run's rollout dump (rollouts/step_N.jsonl
    # or the rollouts/ directory, written with trainer.dump_to_file=true).
    lengths: str | None = None
    # Share of each server's KV pool left free for the engine's own retraction: it admits
    # by KV availability and retracts running requests when their growth overruns it.
    kv_headroom: float = 0.1

    def __post_init__(self):
        check_positive("gpu_memory_gb", self.gpu_memory_gb)
        check_positive("margin_gb", self.margin_gb, allow_zero=True)
        if not 0 <= self.kv_headroom < 1:
            raise field_error("kv_headroom", self.kv_headroom, "must be in [0, 1)")
