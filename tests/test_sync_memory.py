"""The distributed weight sync's device memory at TP=2, on the emulated device
(tests/_fake_cuda.py: ``CountingCuda`` counts its live bytes), against what the memory plan
charges for it (weight_sync/buckets.py: ``sync_memory_bytes``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from _actor_setup import VOCAB
from _dist import run_gloo
from _tiny_model import tiny_qwen2

from areal_mcore.model import adapter
from areal_mcore.model.args import ModelArgs, padded_vocab_size
from areal_mcore.weight_sync.buckets import largest_unit_elements, make_plan, sync_memory_bytes

pytestmark = pytest.mark.multirank

# 16 KB: a few units per bucket, the 64 KB vocabulary in a bucket of its own; 128 KB: many
# units per bucket (the default 1 GiB bucket of a 1.5B model holds dozens).
BUCKETS = (1 << 14, 1 << 17)


def _push_at_tp2(rank, world, bucket_sizes):
    """Every bucket of a TP=2 stage as ``DistributedSync._send_stage`` makes them: bucket
    k + 1 gathered while bucket k's payload (on the wire) is held. Per bucket size: the most
    bytes the emulated device held beyond the actor's weights, the decoded payloads and the
    largest unit's bytes."""
    return [_push_buckets(rank, bucket) for bucket in bucket_sizes]


def _push_buckets(rank, bucket):
    import torch.distributed as dist
    from _fake_cuda import CountingCuda, nccl_like

    from areal_mcore.rollout.weights import ReusableBuffer
    from areal_mcore.weight_sync.distributed import DistributedSync
    from areal_mcore.weight_sync.syncer import SyncStats

    config, state, _ = tiny_qwen2(0, vocab=VOCAB)
    args = ModelArgs.from_hf(config)
    shard = adapter.from_hf(state, args, tp_rank=rank, tp_size=2, pp_rank=0, pp_size=1,
                            padded_vocab=padded_vocab_size(VOCAB, 2))
    plan = make_plan({n: t.shape for n, t in shard.items()}, args, tp_size=2, pp_rank=0, pp_size=1,
                     dtype="float32", bucket_bytes=bucket)
    tp = dist.new_group([0, 1])
    nccl_like(setattr, tp)  # TP shards are all-gathered on the device, as over NCCL
    got = {}
    with CountingCuda() as device:
        weights = {n: t.to("cuda") for n, t in shard.items()}
        syncer = DistributedSync.__new__(DistributedSync)  # what _gather reads of one
        syncer.g = SimpleNamespace(tp=tp, tp_size=2, tp_rank=rank, ep=None, ep_rank=0, ep_size=1,
                                   pp_rank=0, pp_size=1)
        syncer.roles = SimpleNamespace(sender=rank == 0)
        syncer.actor = SimpleNamespace(args=args, model=SimpleNamespace(module=SimpleNamespace(
            named_parameters=weights.items)))
        syncer._buffers = (ReusableBuffer("cuda"), ReusableBuffer("cuda"))
        syncer._flatten = lambda: True
        actor_bytes = device.live()
        device.reset_peak()
        stats, payload = SyncStats(), None
        for i in range(len(plan.buckets)):
            payload = syncer._gather(plan, i, stats)  # the previous payload is held meanwhile
            if payload is not None:
                names, shapes = plan.bucket_meta(i)
                parts = payload[0].cpu().view(torch.float32).split([torch.Size(s).numel() for s in shapes])
                got.update({n: p.view(s).clone() for n, p, s in zip(names, parts, shapes, strict=True)})
        peak = device.peak - actor_bytes
    return peak, got, max(u.nbytes(torch.float32) for b in plan.buckets for u in b)


def test_a_push_at_tp2_holds_no_more_device_memory_than_the_plan_charges():
    """While bucket k is on the wire, bucket k + 1 was gathered whole over TP, concatenated
    into HF tensors and packed into the second buffer, all held at once: about four buckets
    where the plan charged two. Unit by unit, one unit's shards and concatenation are held
    beside the two buffers, and the plan charges that."""
    config, state, _ = tiny_qwen2(0, vocab=VOCAB)
    args = ModelArgs.from_hf(config)
    padded = padded_vocab_size(VOCAB, 2)
    head, peer = run_gloo(_push_at_tp2, 2, BUCKETS)
    for bucket, (peak, got, largest), (peer_peak, _, _) in zip(BUCKETS, head, peer, strict=True):
        charged = sync_memory_bytes(args, bucket_bytes=bucket, dtype_bytes=4, actor_dtype_bytes=4, tp=2,
                                    padded_vocab=padded)
        print(f"sync memory at TP=2, {bucket} B buckets: stage head {peak} B, TP peer {peer_peak} B, "
              f"charged {charged} B")
        assert 0 < peak <= charged, (bucket, peak, charged)
        assert 0 < peer_peak <= charged, (bucket, peer_peak, charged)
        assert largest_unit_elements(args) * 4 == largest  # the plan's analytic unit is the real one
        assert set(got) == set(state) and all(torch.equal(got[k], v) for k, v in state.items())
