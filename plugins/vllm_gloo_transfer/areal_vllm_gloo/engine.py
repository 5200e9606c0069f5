"""The worker side of areal-mcore's gloo weight transfer inside vLLM.

Group: the same torch calls as SGLang's ``init_custom_process_group`` and areal-mcore's
trainer (``weight_sync/group.py``): a client of the trainer's TCPStore ->
``PrefixStore(group_name)`` -> torch's ``_new_process_group_helper`` (which adds its own
``"{group_name}/"`` and ``"{device}/"`` prefixes), group ranks mapped to themselves so
``broadcast(src=0)`` means the trainer on both sides. This worker's rank is computed as
vLLM's NCCL engine computes it (``nccl_common.worker_init_process_group``):
``dp_index * (TP*PP) + parallel_config.rank + rank_offset``.

One group per trainer pipeline stage (``stage`` in the init info): every stage head sends
its own layers. A new init for a stage replaces (destroys) that stage's previous group:
vLLM has no route to destroy one, and a restarted trainer must be able to connect again.

Buckets: ``packed`` = one broadcast of the bucket's bytes as ``uint8`` (the trainer packs
them back to back in send order, each tensor at an offset aligned to its dtype), else one
broadcast per tensor. Received tensors go to ``self.model.load_weights`` inside vLLM's
layerwise reload, as its NCCL engine does.
"""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.logger import init_logger

logger = init_logger(__name__)


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    stage: int = 0
    timeout_s: float = 600.0


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    stage: int = 0
    packed: bool = True

    def __post_init__(self):
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(f"names, dtype_names and shapes differ in length: {len(self.names)}, "
                             f"{len(self.dtype_names)}, {len(self.shapes)}")


def join_group(info: GlooInitInfo, rank: int) -> dist.ProcessGroup:
    """Joins the trainer's group as ``rank`` (the trainer hosts the store as rank 0)."""
    timeout = datetime.timedelta(seconds=info.timeout_s)
    store = dist.TCPStore(info.master_address, info.master_port, info.world_size,
                          is_master=False, timeout=timeout, multi_tenant=True)
    pg, _ = c10d._new_process_group_helper(
        info.world_size, rank, [], c10d.Backend("gloo"), dist.PrefixStore(info.group_name, store),
        group_name=info.group_name, backend_options=None, timeout=timeout)
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(info.world_size)}
    return pg


def refresh_tied_lm_head(model: torch.nn.Module, model_config) -> None:
    """Re-packs a tied LM head's CPU GEMM from the embedding just loaded.

    On CPU, ``UnquantizedEmbeddingMethod.process_weights_after_loading`` gives the LM head a
    ``cpu_linear`` over a packed copy of its weight (``layers/utils.py:
    dispatch_cpu_unquantized_gemm``: sgl-kernel ``convert_weight_packed`` or a oneDNN
    handler). A tied model's checkpoint has no ``lm_head.weight``, so the layerwise reload
    loads nothing into the head ("ParallelLMHead: Failed to load weights" in vLLM's log),
    puts its old tensors back (``layerwise.py: finalize_layerwise_processing``) and never
    re-packs: the embedding changed, the logits kept the first weights (measured: greedy
    logprobs off the trainer's by 0.76 after one sync). The head's weight is the
    embedding's storage, which the reload updated in place, so packing it again is all
    that is missing. On GPU the method keeps no copy (the branch is CPU only)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
    from vllm.platforms import current_platform

    if not (current_platform.is_cpu() and getattr(model_config.hf_config, "tie_word_embeddings", False)):
        return
    for layer in model.modules():
        if isinstance(layer, ParallelLMHead) and hasattr(layer, "cpu_linear"):
            layer.quant_method.process_weights_after_loading(layer)


def prepack_cpu_experts_on_every_update() -> None:
    """Makes vLLM-CPU re-pack an MoE layer's experts after every weight update, not only
    after the first load.

    ``UnquantizedFusedMoEMethod._setup_kernel`` (``layers/fused_moe/
    unquantized_fused_moe_method.py``) copies the freshly loaded ``w13``/``w2`` into the
    parameters and calls the experts' ``process_weights_after_loading`` only on the first
    call ("Setup moe kernel only on the first call"); on CPU that method is what packs the
    weights into the grouped-GEMM layout the kernel reads (``experts/cpu_moe.py``:
    ``cpu_prepack_moe_weight``). So every reload (``reload_weights`` from disk, or our
    layerwise update) left unpacked weights under a kernel that reads packed ones:
    measured, a Qwen3-MoE reloaded with the very weights it served was ~0.1 off in
    logprobs (``tools/check_vllm_arch.py qwen3_moe --reload``). Packing the new weights
    again is what is missing. CPU only: on GPU the method does no such packing here."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method as moe

    original = moe.UnquantizedFusedMoEMethod._setup_kernel
    if getattr(original, "areal_prepacks", False):
        return

    def setup_kernel(self, *args, **kwargs):
        update = self.moe_kernel is not None
        original(self, *args, **kwargs)
        if update:
            layer = kwargs["layer"] if "layer" in kwargs else args[0]
            self.moe_kernel.fused_experts.process_weights_after_loading(layer)

    setup_kernel.areal_prepacks = True
    moe.UnquantizedFusedMoEMethod._setup_kernel = setup_kernel


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.groups: dict[int, dist.ProcessGroup] = {}

    def worker_rank(self) -> int:
        p = self.parallel_config
        return p.data_parallel_index * p.world_size + p.rank

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        old = self.groups.pop(init_info.stage, None)
        if old is not None:
            dist.destroy_process_group(old)
        rank = self.worker_rank() + init_info.rank_offset
        logger.info("areal_gloo: joining group %s (stage %d) as rank %d of %d",
                    init_info.group_name, init_info.stage, rank, init_info.world_size)
        self.groups[init_info.stage] = join_group(init_info, rank)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        refresh_tied_lm_head(self.model, self.model_config)

    def update_weights(self, update_info: dict) -> None:
        # The base class ends with torch.accelerator.synchronize(); gloo on CPU has
        # finished when wait() returns.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        group = self.groups.get(update_info.stage)
        if group is None:
            raise RuntimeError(f"areal_gloo: no group for stage {update_info.stage}; call "
                               "/init_weight_transfer_engine first")
        dtypes = [getattr(torch, d) for d in update_info.dtype_names]
        if update_info.packed:
            sizes, offset = [], 0
            for name, dtype, shape in zip(update_info.names, dtypes, update_info.shapes):
                if offset % dtype.itemsize:
                    raise ValueError(f"unaligned tensor {name} in a packed bucket at byte {offset}")
                sizes.append(math.prod(shape) * dtype.itemsize)
                offset += sizes[-1]
            flat = torch.empty(offset, dtype=torch.uint8)
            group.broadcast(flat, 0).wait()
            tensors = [part.view(dtype).view(shape) for part, dtype, shape
                       in zip(flat.split(sizes), dtypes, update_info.shapes)]
        else:
            tensors = [torch.empty(shape, dtype=dtype)
                       for dtype, shape in zip(dtypes, update_info.shapes)]
            works = [group.broadcast(t, 0) for t in tensors]
            for w in works:
                w.wait()
        self.model.load_weights(list(zip(update_info.names, tensors)))

    def shutdown(self) -> None:
        for pg in self.groups.values():
            dist.destroy_process_group(pg)
        self.groups.clear()

    @staticmethod
    def trainer_send_weights(iterator, trainer_args) -> None:
        raise NotImplementedError("areal-mcore's trainer sends from weight_sync/syncer.py")
