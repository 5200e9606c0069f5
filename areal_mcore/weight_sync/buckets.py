"""The weight-sync plan of one pipeline stage: which HF tensors it sends, in what dtype,
in which bucket. Computed once from the model's parameter shapes, reused every step.

A *unit* is one megatron parameter and the HF tensors it becomes (q/k/v, gate/up split);
a unit is gathered and converted as a whole, so bucket boundaries fall between units.
Buckets fill in model order up to ``bucket_bytes``; a unit larger than the budget gets a
bucket of its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from areal_mcore.model import adapter
from areal_mcore.model.args import ModelArgs

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Unit:
    mcore: str  # megatron parameter name (stage-local)
    hf: tuple[tuple[str, tuple[int, ...]], ...]  # (HF name, HF shape) it converts to
    kind: str  # its ParamMap.kind: how its TP shards merge (adapter.merge)
    # Experts: the expert-parallel rank whose ``mcore`` (a local expert) this is; every EP
    # rank has the same local names, each for other global experts. None: not an expert.
    ep_rank: int | None = None

    def nbytes(self, dtype: torch.dtype) -> int:
        return sum(math.prod(shape) for _, shape in self.hf) * dtype.itemsize


@dataclass(frozen=True)
class SyncPlan:
    pp_rank: int
    dtype: str
    buckets: tuple[tuple[Unit, ...], ...]
    key: tuple  # the shapes it was made from: a different model needs a new plan

    @property
    def nbytes(self) -> int:
        return sum(u.nbytes(DTYPES[self.dtype]) for b in self.buckets for u in b)

    def bucket_meta(self, i: int) -> tuple[list[str], list[list[int]]]:
        """HF names and shapes of bucket ``i``, in send order."""
        pairs = [(n, list(s)) for u in self.buckets[i] for n, s in u.hf]
        return [n for n, _ in pairs], [s for _, s in pairs]


def plan_key(shard_shapes: dict[str, torch.Size]) -> tuple:
    return tuple(sorted((n, tuple(s)) for n, s in shard_shapes.items()))


def make_plan(shard_shapes: dict[str, torch.Size], args: ModelArgs, *, tp_size: int, pp_rank: int,
              pp_size: int, dtype: str, bucket_bytes: int, ep_size: int = 1) -> SyncPlan:
    """Plans a stage from its TP shard shapes (megatron names -> shapes on this rank).

    HF shapes come from running the adapter's merge on meta tensors, so the plan can never
    disagree with the conversion it schedules. With expert parallelism (``ep_size`` > 1)
    each local expert weight is one unit per EP rank (its global experts' HF names), next
    to each other in layer order: every expert of the stage is sent once.
    """
    if dtype not in DTYPES:
        raise ValueError(f"weight_sync.dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    meta = {n: torch.empty(s, device="meta") for n, s in shard_shapes.items()}
    per_ep = [list(adapter.stage_entries(args, pp_rank, pp_size, tied_copy=False, ep_rank=r, ep_size=ep_size))
              for r in range(ep_size)]
    units = []
    for same in zip(*per_ep, strict=True):  # the same megatron name on every EP rank
        p, name, _ = same[0]
        for r in range(ep_size) if p.per_expert else (None,):
            hf = adapter.to_hf([meta] * tp_size, args, pp_rank=pp_rank, pp_size=pp_size, only={name},
                               ep_rank=r or 0, ep_size=ep_size)
            units.append(Unit(mcore=name, hf=tuple((n, tuple(t.shape)) for n, t in hf.items()), kind=p.kind,
                              ep_rank=r))
    sizes = [u.nbytes(DTYPES[dtype]) for u in units]
    buckets = tuple(tuple(units[i] for i in b) for b in assign_buckets(sizes, bucket_bytes))
    return SyncPlan(pp_rank=pp_rank, dtype=dtype, buckets=buckets, key=plan_key(shard_shapes))


def assign_buckets(sizes: list[int], budget: int) -> list[list[int]]:
    """Consecutive groups of indices with sum(sizes) <= budget; an item over the budget
    alone in its group. Order is kept (the receiver loads in order; layers stream)."""
    if budget <= 0:
        raise ValueError(f"bucket budget must be > 0 bytes, got {budget}")
    buckets: list[list[int]] = []
    used = budget + 1  # forces a new bucket for the first item
    for i, size in enumerate(sizes):
        if used + size > budget:
            buckets.append([])
            used = 0
        buckets[-1].append(i)
        used += size
    return buckets


def largest_unit_elements(args: ModelArgs, padded_vocab: int | None = None) -> int:
    """Elements of the model's largest unit (one megatron parameter's HF tensors, or its
    gathered TP shards: the vocabulary ``padded_vocab`` rows then): the embedding or lm
    head, a fused q/k/v, a dense, shared or expert gate/up."""
    h = args.hidden_size
    return max((padded_vocab or args.vocab_size) * h, (args.num_heads + 2 * args.num_kv_heads) * args.head_dim * h,
               2 * h * max(args.ffn_hidden_size, args.moe_ffn_hidden_size, args.shared_expert_ffn_hidden_size))


def sync_memory_bytes(args: ModelArgs, *, bucket_bytes: int, dtype_bytes: int, actor_dtype_bytes: int,
                      tp: int, ep: int = 1, padded_vocab: int | None = None) -> int:
    """Device memory a distributed push holds beyond the actor's (``distributed._gather``):
    two bucket buffers, each the larger of a bucket and the largest unit (which gets a
    bucket of its own); and where units are gathered, one unit's worth in the actor's dtype:
    at TP > 1 its all-gathered shards and their concatenation (``adapter.merge``), at EP > 1
    the shard of another EP rank's expert (broadcast into a fresh tensor)."""
    unit = largest_unit_elements(args, padded_vocab)
    held = (2 if tp > 1 else 0) + (1 / tp if ep > 1 else 0)
    return int(2 * max(bucket_bytes, unit * dtype_bytes) + held * unit * actor_dtype_bytes)
