"""``save_hf(actor, dir)``: the trainer's in-training HF export, written by the actor's ranks.

Every rank calls it. TP ranks gather their stage's weights; one rank per pipeline stage
(TP rank 0, DP rank 0) writes that stage's shards, so no rank holds the whole model;
global rank 0 then numbers the shards and writes the index, config and tokenizer files.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from areal_mcore import collectives
from areal_mcore.actor.megatron_actor import MegatronActor
from areal_mcore.convert.hf_writer import (
    ShardedSafetensorsWriter,
    finalize_shards,
    write_model_files,
)


def save_hf(actor: MegatronActor, out_dir: str | Path, *, tokenizer_dir: str | Path | None = None,
            max_shard_bytes: int = 2 << 30, dtype: torch.dtype | None = None) -> None:
    g = actor.groups
    out = Path(out_dir)
    if dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
    collectives.barrier(dist.group.WORLD)
    tensors = actor.hf_state_dict()  # collective over the TP group
    parts = []
    if g.tp_rank == 0 and g.dp_rank == 0:
        writer = ShardedSafetensorsWriter(out, max_shard_bytes, dtype, prefix=f"stage{g.pp_rank:03d}")
        writer.add(tensors)
        parts = writer.written_parts()
    del tensors
    gathered = collectives.all_gather_object((g.pp_rank, parts), dist.group.WORLD)
    if dist.get_rank() == 0:
        ordered = [p for _, stage_parts in sorted(x for x in gathered if x[1]) for p in stage_parts]
        finalize_shards(out, ordered)
        write_model_files(out, actor.hf_config, tokenizer_dir)
    collectives.barrier(dist.group.WORLD)
