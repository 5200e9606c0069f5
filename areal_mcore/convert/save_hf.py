"""``save_hf(actor, dir)``: the trainer's in-training HF export, written by the actor's ranks.

Every rank calls it. One rank per pipeline stage (TP, DP and CP rank 0) gathers its
stage's weights (over TP and EP) and writes that stage's shards, so no rank holds the whole
model and no other rank holds more than its own parameters;
global rank 0 then numbers the shards and writes the index, config and tokenizer files.
"""

from __future__ import annotations

import os
import shutil
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
    """Writes into a hidden sibling folder renamed over ``out_dir`` once complete: a kill
    mid-export leaves the previous folder (or none), never a partial one."""
    g = actor.groups
    final = Path(out_dir)
    out = final.with_name(f".{final.name}.tmp")
    if dist.get_rank() == 0:
        shutil.rmtree(out, ignore_errors=True)  # a killed export's
        out.mkdir(parents=True)
    collectives.barrier(dist.group.WORLD)
    tensors = actor.hf_state_dict(writer_only=True)  # collective over the TP (and EP) group
    parts = []
    if g.tp_rank == 0 and g.dp_rank == 0 and g.cp_rank == 0:  # hf_state_dict's writer (CP ranks are replicas)
        writer = ShardedSafetensorsWriter(out, max_shard_bytes, dtype, prefix=f"stage{g.pp_rank:03d}")
        writer.add(tensors)
        parts = writer.written_parts()
    del tensors
    gathered = collectives.all_gather_object((g.pp_rank, parts), dist.group.WORLD)
    if dist.get_rank() == 0:
        ordered = [p for _, stage_parts in sorted(x for x in gathered if x[1]) for p in stage_parts]
        finalize_shards(out, ordered)
        write_model_files(out, actor.hf_config, tokenizer_dir)
        _replace_dir(out, final)
    collectives.barrier(dist.group.WORLD)


def _replace_dir(new: Path, final: Path) -> None:
    """``new`` takes ``final``'s place (a directory cannot be renamed over a full one: the
    old one steps aside first, and goes once the new one is in place)."""
    old = final.with_name(f".{final.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.replace(final, old)
    os.replace(new, final)
    shutil.rmtree(old, ignore_errors=True)
