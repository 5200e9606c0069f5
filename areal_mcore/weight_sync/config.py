"""The weight sync's config (``weight_sync:`` in an experiment's YAML)."""

from __future__ import annotations

from dataclasses import dataclass

from areal_mcore.checks import check_choice, check_positive, field_error
from areal_mcore.rollout.protocol import PAUSE_MODES
from areal_mcore.weight_sync.buckets import DTYPES

MODES = ("distributed", "disk")


@dataclass(kw_only=True)
class WeightSyncConfig:
    mode: str = "distributed"  # or "disk": HF export + update_weights_from_disk
    bucket_mb: float = 1024.0  # AReaL uses 1 GB, slime 512 MB
    dtype: str = "bfloat16"  # the rollout dtype
    flatten: bool = True  # one broadcast per bucket (load_format=flattened_bucket)
    backend: str = "auto"  # nccl with CUDA, else gloo
    master_address: str | None = None  # None: this node's address on the route to the servers
    master_port: int | None = None  # stage s uses master_port + s; None: a free port
    group_name: str = "areal_weight_sync"  # prefix; each connection adds a unique suffix
    # SGLang's pause_generation mode: abort (requests are resubmitted with what they
    # generated), retract (back to the queue, cache recomputed) or in_place (kept with
    # their cache: old-weight KV, no flush).
    pause_mode: str = "abort"
    # mode=disk: where the HF export goes; under the run directory (a relative path is
    # taken from it), the only tree the run's servers load from (weight_sync/disk.py).
    disk_dir: str | None = None
    timeout_s: float = 600.0  # the update groups' (store, rendezvous, NCCL watchdog)
    # How long one bucket's broadcast may take before the push fails; None: timeout_s / 2.
    # Below timeout_s, so that NCCL's watchdog (which ends the process) never fires first.
    bucket_timeout_s: float | None = None

    def __post_init__(self):
        check_choice("mode", self.mode, MODES)
        check_choice("dtype", self.dtype, tuple(sorted(DTYPES)))
        check_choice("backend", self.backend, ("auto", "nccl", "gloo"))
        check_positive("bucket_mb", self.bucket_mb)
        check_choice("pause_mode", self.pause_mode, PAUSE_MODES)
        if self.bucket_timeout_s is not None and not 0 < self.bucket_timeout_s < self.timeout_s:
            raise field_error("bucket_timeout_s", self.bucket_timeout_s,
                              f"must be > 0 and below timeout_s ({self.timeout_s:g}): the update "
                              "group's own timeout would end the trainer first (NCCL's watchdog)")
        if self.mode == "disk" and not self.disk_dir:
            raise field_error("disk_dir", self.disk_dir, "is needed with mode=disk (a shared filesystem path)")
