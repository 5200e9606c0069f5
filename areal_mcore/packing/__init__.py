"""THD packing and the micro-batch allocator (pure torch; no megatron)."""

from areal_mcore.packing.allocator import allocate_micro_batches, allocate_micro_batches_synced
from areal_mcore.packing.thd import PackedBatch, pack, unpack

__all__ = [
    "PackedBatch",
    "allocate_micro_batches",
    "allocate_micro_batches_synced",
    "pack",
    "unpack",
]
