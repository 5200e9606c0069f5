"""Megatron parallel state from a config, and the process groups handed to our code."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

from areal_mcore.actor.config import ParallelConfig
from areal_mcore.model import mcore_compat
from areal_mcore.model.cpu_shims import apply_cpu_shims


@dataclass(frozen=True)
class ParallelGroups:
    """The groups this rank belongs to; passed explicitly to everything we write."""

    tp: dist.ProcessGroup
    pp: dist.ProcessGroup
    dp: dist.ProcessGroup  # data parallel, without the CP ranks (same dp_rank across a CP group)
    cp: dist.ProcessGroup  # the ranks that split each sequence (size 1: CP off)
    dp_cp: dist.ProcessGroup  # DP x CP: where gradients reduce and loss counts add up
    mp: dist.ProcessGroup  # TP x PP ranks of this data-parallel replica
    ep: dist.ProcessGroup  # ranks whose experts together make every expert (size 1: EP off)
    # expert-TP x EP x PP: one whole copy of the model, experts included (at EP=1 the same
    # ranks as ``mp``), and this rank's index among such copies (expert data parallelism)
    expert_mp: dist.ProcessGroup
    expert_dp_rank: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    cp_rank: int
    cp_size: int
    ep_rank: int
    ep_size: int
    pp_last_rank: int  # global rank of the last stage in this rank's pipeline
    collection: ProcessGroupCollection  # the same groups, in megatron's container

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


def init_parallel(cfg: ParallelConfig, seed: int) -> ParallelGroups:
    """Initialises megatron's model-parallel state on the already-initialised world.

    megatron's layers and schedules read these groups from ``parallel_state``; our code
    (allocator, normalisation, weight gathering) gets them from the returned object.
    """
    if not dist.is_initialized():
        raise RuntimeError("init_process_group first (torchrun, or gloo in tests)")
    world = dist.get_world_size()
    if world % (cfg.tp * cfg.pp * cfg.cp):
        raise ValueError(f"world size {world} is not divisible by tp={cfg.tp} x pp={cfg.pp} x cp={cfg.cp}")
    # megatron lays the expert grid (expert-TP x EP x expert-DP x PP) over the same world
    # as TP x DP x PP and raises a RuntimeError when expert-TP x EP x PP does not divide it
    # (parallel_state.initialize_model_parallel, "expert rank generator"). With expert-TP =
    # TP (below), EP must divide the data-parallel size.
    if world % (cfg.tp * cfg.ep * cfg.pp):
        raise ValueError(f"actor.parallel.ep={cfg.ep}: world size {world} is not divisible by "
                         f"tp={cfg.tp} x ep={cfg.ep} x pp={cfg.pp}; ep must divide the data-parallel "
                         f"size x cp, {world // (cfg.tp * cfg.pp)}")
    mcore_compat.warn_if_untested()
    apply_cpu_shims()
    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=cfg.tp, pipeline_model_parallel_size=cfg.pp,
        context_parallel_size=cfg.cp,
        # Expert-TP = TP (megatron's default when None): each expert is split over the TP
        # group like a dense MLP, so the adapter's TP sharding of experts holds at any EP,
        # and the expert-TP group is the TP group the actor gathers over.
        expert_model_parallel_size=cfg.ep, expert_tensor_parallel_size=cfg.tp,
    )
    model_parallel_cuda_manual_seed(seed)
    return ParallelGroups(
        tp=mpu.get_tensor_model_parallel_group(),
        pp=mpu.get_pipeline_model_parallel_group(),
        dp=mpu.get_data_parallel_group(),
        cp=mpu.get_context_parallel_group(),
        dp_cp=mpu.get_data_parallel_group(with_context_parallel=True),
        cp_rank=mpu.get_context_parallel_rank(),
        cp_size=cfg.cp,
        mp=mpu.get_model_parallel_group(),
        tp_rank=mpu.get_tensor_model_parallel_rank(),
        tp_size=cfg.tp,
        pp_rank=mpu.get_pipeline_model_parallel_rank(),
        pp_size=cfg.pp,
        dp_rank=mpu.get_data_parallel_rank(),
        dp_size=mpu.get_data_parallel_world_size(),
        ep=mpu.get_expert_model_parallel_group(),
        ep_rank=mpu.get_expert_model_parallel_rank(),
        ep_size=cfg.ep,
        expert_mp=mpu.get_expert_tensor_model_pipeline_parallel_group(),
        expert_dp_rank=mpu.get_expert_data_parallel_rank(),
        pp_last_rank=mpu.get_pipeline_model_parallel_last_rank(),
        collection=ProcessGroupCollection.use_mpu_process_groups(),
    )
