"""Per-replica dispatch of rollout samples (trainer/dispatch.py) on gloo ranks."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from _dist import run_gloo
from test_ppo_e2e import _overrides

from areal_mcore.config import load_config
from areal_mcore.data.tiny_assets import TinyAssetsConfig, build_tiny_assets
from areal_mcore.rollout.trajectory import Sample
from areal_mcore.trainer.dispatch import (
    Dispatcher,
    RolloutShard,
    SamplePacker,
    send_batches,
    split_groups,
)


def _samples(n_groups: int, n: int, seed: int = 0) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for gi in range(n_groups):
        prompt = torch.randint(0, 1000, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n):
            k = int(torch.randint(1, 17, (1,), generator=g))
            out.append(Sample(group=gi, prompt_ids=prompt, output_ids=torch.randint(0, 1000, (k,), generator=g).tolist(),
                              logprobs=(-torch.rand(k, generator=g, dtype=torch.float64)).tolist(),
                              versions=torch.randint(0, 5, (k,), generator=g).tolist(),
                              reward=float(torch.randint(0, 2, (1,), generator=g)),
                              finish_reason="length" if k % 3 == 0 else "stop",
                              start_version=0))
    return out


def _as_lists(shard: RolloutShard) -> dict:
    return {k: getattr(shard, k).tolist() for k in
            ("prompt_lens", "output_lens", "tokens", "logprobs", "versions", "rewards", "truncated")}


def test_shard_bytes_round_trip_and_values_match_the_samples():
    samples = _samples(3, 4)
    shard = RolloutShard.from_samples(samples)
    back = RolloutShard.from_bytes(shard.header(), shard.to_bytes())
    assert _as_lists(back) == _as_lists(shard)
    assert shard.tokens.tolist() == [t for s in samples for t in s.prompt_ids + s.output_ids]
    assert 0 < sum(back.truncated.tolist()) < len(samples)  # ppo.mask_truncated_samples reads it
    assert back.truncated.tolist() == [int(s.finish_reason == "length") for s in samples]
    # float32 exactly as torch.tensor(list).float() rounds them (what the batch used before)
    assert torch.equal(shard.logprobs, torch.tensor([lp for s in samples for lp in s.logprobs]).float())
    assert shard.nbytes == shard.to_bytes().numel() == RolloutShard.nbytes_of(shard.header())


def test_arrays_packed_on_arrival_give_the_same_shard_and_die_with_their_samples():
    import gc

    samples = _samples(3, 4)
    packer = SamplePacker()
    for i in range(0, len(samples), 4):  # as RolloutExecutor.on_group sees them
        packer(samples[i:i + 4])
    assert _as_lists(RolloutShard.from_samples(samples, packer)) == _as_lists(RolloutShard.from_samples(samples))
    assert RolloutShard.from_samples(samples + _samples(1, 4, seed=5), packer).num_samples == 16  # lists fallback
    assert len(packer) == 12
    assert RolloutShard.from_samples([], packer).num_samples == 0  # a replica without groups
    del samples
    gc.collect()
    assert len(packer) == 0


def _dispatch_rank(rank, world, samples, n):
    # DP 2 x "TP" 2: replicas {0, 1} and {2, 3}; the model-parallel groups as megatron
    # would form them (every rank creates every group).
    mps = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    d = Dispatcher(dp_rank=rank // 2, dp_size=2, mp_group=mps[rank // 2], world=dist.group.WORLD,
                   control=dist.new_group(backend="gloo"))
    shard, st = d.dispatch(samples if rank == 0 else None, n)
    return d.heads, _as_lists(shard), st.bytes_sent, st.bytes_received


@pytest.mark.multirank
def test_each_replica_receives_only_its_groups_once_then_its_model_parallel_peers():
    n = 4
    samples = _samples(6, n)
    out = run_gloo(_dispatch_rank, 4, samples, n)
    parts = [RolloutShard.from_samples(p) for p in split_groups(samples, n, 2)]
    assert [s.group for s in split_groups(samples, n, 2)[1]] == [1] * n + [3] * n + [5] * n
    for rank, (heads, got, _, received) in enumerate(out):
        assert heads == [0, 2]
        assert got == _as_lists(parts[rank // 2])  # its replica's samples, nothing else
        wire = parts[rank // 2].nbytes + 32  # + the int64[4] header
        assert received == (0 if rank == 0 else wire)
    assert out[0][2] == parts[1].nbytes + 32  # rank 0 sent replica 1's share, once


def _cp_dispatch_rank(rank, world, samples, n):
    # megatron's own groups (tp-cp-ep-dp-pp order): TP 2 x CP 2 (one replica: the head
    # sends over CP, then each CP rank's TP group), then DP 2 x CP 2 (a replica head on
    # rank 2 receives, and passes it to its CP peer).
    from megatron.core import parallel_state as mpu

    out = []
    for tp, cp in ((2, 2), (1, 2)):
        mpu.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
        d = Dispatcher(dp_rank=mpu.get_data_parallel_rank(), dp_size=mpu.get_data_parallel_world_size(),
                       mp_group=mpu.get_model_parallel_group(), cp_group=mpu.get_context_parallel_group(),
                       world=dist.group.WORLD, control=dist.new_group(backend="gloo"))
        shard, _ = d.dispatch(samples if rank == 0 else None, n)
        out.append((d.heads, mpu.get_data_parallel_rank(), _as_lists(shard)))
        mpu.destroy_model_parallel()
    return out


@pytest.mark.multirank
def test_context_parallel_ranks_of_a_replica_all_receive_its_samples():
    """A replica is CP x TP x PP ranks, but megatron's model-parallel group leaves CP out:
    every CP rank needs the replica's samples (each splits every sequence itself)."""
    n = 4
    samples = _samples(6, n)
    out = run_gloo(_cp_dispatch_rank, 4, samples, n)
    whole = _as_lists(RolloutShard.from_samples(samples))
    halves = [_as_lists(RolloutShard.from_samples(p)) for p in split_groups(samples, n, 2)]
    for rank, ((heads1, dp1, got1), (heads2, dp2, got2)) in enumerate(out):
        assert (heads1, dp1, got1) == ([0], 0, whole)
        assert (heads2, dp2) == ([0, 2], rank // 2)  # ranks 0, 1: CP ranks of replica 0
        assert got2 == halves[rank // 2]


def _late_rank_0(rank, world, samples, n):
    import time
    from datetime import timedelta

    # The data group's timeout stands for NCCL's 10 min watchdog, scaled down to 2 s.
    data = dist.new_group(backend="gloo", timeout=timedelta(seconds=2))
    control = dist.new_group(backend="gloo", timeout=timedelta(seconds=120))
    d = Dispatcher(dp_rank=rank, dp_size=2, mp_group=None, world=data, control=control)
    if rank == 0:
        time.sleep(5)  # generating the batch
    shard, _ = d.dispatch(samples if rank == 0 else None, n)
    return _as_lists(shard)


@pytest.mark.multirank
def test_ranks_wait_out_rank_0s_rollout_on_the_control_groups_timeout_not_the_data_groups():
    """The other ranks wait for rank 0's batch as long as a rollout takes: on the trainer's
    gloo control group (trainer.wait_timeout_s), not in a receive on the data group, which
    on NCCL its watchdog aborts after 10 min."""
    samples = _samples(4, 4)
    out = run_gloo(_late_rank_0, 2, samples, 4)
    assert out == [_as_lists(RolloutShard.from_samples(p)) for p in split_groups(samples, 4, 2)]


# ---- the PPO loop at DP=2: dispatch trains bitwise as the pickled broadcast did ------------

def _pickled_rollout(self, step):
    """PPORun.rollout before #16 (the whole batch pickled to every rank), the reference."""
    box = [None, None]
    if self.rank == 0:
        side = self.rollout_side
        out = self.loop.run(side.executor.wait(self.cfg.trainer.batch_size))
        box = [out.samples, out.stats]
    dist.broadcast_object_list(box, src=0, group=dist.group.WORLD)
    samples, stats = box
    g, n = self.actor.groups, self.cfg.rollout.n_samples
    groups = [samples[i:i + n] for i in range(0, len(samples), n)]
    return [s for grp in groups[g.dp_rank::g.dp_size] for s in grp], stats


def _ppo_rank(rank, world, overrides, pickled):
    from areal_mcore.trainer import ppo

    seen = []  # rank 0: every replica's expected share; others: what arrived
    if pickled:
        ppo.PPORun.rollout = _pickled_rollout
    else:
        real = Dispatcher.dispatch

        def recording(self, samples, group_size, packer=None):
            assert rank != 0 or packer.arrays_of(samples) is not None  # packed as they arrived
            shard, st = real(self, samples, group_size, packer)
            expected = ([_as_lists(RolloutShard.from_samples(p)) for p in split_groups(samples, group_size, 2)]
                        if rank == 0 else None)
            seen.append((_as_lists(shard), expected, st.bytes_received))
            return shard, st
        Dispatcher.dispatch = recording
    history = ppo.train(load_config(None, overrides))
    return [{k: r[k] for k in ("train/loss", "train/grad_norm", "train/approx_kl")} for r in history], seen


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.server
def test_ppo_at_dp2_with_dispatch_trains_bitwise_like_the_pickled_broadcast(tmp_path):
    assets = build_tiny_assets(TinyAssetsConfig(out_dir=str(tmp_path / "assets"), n_train=64, n_test=8,
                                                hidden_size=64, intermediate_size=128, num_layers=2))
    # Unnormalised rewards (a random model solves nothing, so normalised advantages would be 0)
    # and two minibatches: the loss and grads depend on every token, logprob and version.
    # One request at a time on the server: batched decoding changes logprobs in the last bits
    # with the batch's make-up (timing), which would hide what this test compares.
    extra = ("actor.optimizer.lr=1e-4", "rollout.max_new_tokens=16", "rollout.n_samples=4",
             "server.context_length=512", "trainer.total_steps=3", "ppo.reward_bias=-0.5",
             "ppo.reward_scaling=10.0", "ppo.reward_norm=null", "ppo.adv_norm=null",
             "ppo.use_decoupled_loss=true", "ppo.ppo_n_minibatches=2",
             "server.max_running_requests=1")
    new = run_gloo(_ppo_rank, 2, _overrides(assets, tmp_path / "a", "dispatch", *extra), False)
    old = run_gloo(_ppo_rank, 2, _overrides(assets, tmp_path / "b", "pickled", *extra), True)
    for rank in range(2):
        assert new[rank][0] == old[rank][0]  # losses, grad norms, KL: bitwise
    assert all(math.isfinite(x) and x > 0 for r in new[0][0] for x in r["train/grad_norm"])
    for step, ((got0, expected, _), (got1, _, received1)) in enumerate(zip(new[0][1], new[1][1])):
        assert got0 == expected[0] and got1 == expected[1], step  # rank 1 got replica 1's samples only
        b, t, o = (len(expected[1][k]) for k in ("rewards", "tokens", "logprobs"))
        assert received1 == 32 + 24 * b + 4 * t + 8 * o  # header + int64 x 2, float32, int32 per sample...


def test_the_dispatch_cost_model_adds_its_documented_terms():
    from areal_mcore.trainer.dispatch_projection import BatchShape, DispatchLink, predict_dispatch_s

    shape = BatchShape(samples=10, tokens=1000, response_tokens=600)  # 4*1000 + 8*600 + 24*10 bytes
    assert shape.wire_bytes == 9040 and shape.elements == 2200
    link = DispatchLink(link_GBps=1e-6, mp_GBps=1e-6, h2d_GBps=1e-6, alpha_s=0.5)  # 1 kB/s: seconds = kB
    p = predict_dispatch_s(shape, replicas=4, mp_size=8, t_elem_s=1e-3, link=link)
    assert p["pack_s"] == pytest.approx(2.2) and p["h2d_s"] == pytest.approx(9.04)
    assert p["send_s"] == pytest.approx(9.04 * 3 / 4 + 2 * 3 * 0.5)  # three heads, header + buffer each
    assert p["bcast_s"] == pytest.approx(9.04 / 4 + 2 * 3 * 0.5)  # a quarter, log2(8) = 3 hops
    assert p["total_s"] == pytest.approx(sum(v for k, v in p.items() if k != "total_s"))
    arrays = predict_dispatch_s(shape, replicas=4, mp_size=8, t_elem_s=1e-3, link=link, concat_GBps=1e-6)
    assert arrays["pack_s"] == pytest.approx(18.08)  # two copies of the buffer


def _counted_dispatch(rank, world, samples, n):
    calls = []  # lone sends/receives, and each batch's ops
    for name in ("send", "recv", "batch_isend_irecv"):
        real = getattr(dist, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls.append(_name if _name != "batch_isend_irecv" else sorted(op.op.__name__ for op in args[0]))
            return _real(*args, **kwargs)
        setattr(dist, name, counted)  # (not isend/irecv: P2POp accepts only the real ones)
    d = Dispatcher(dp_rank=rank, dp_size=world, mp_group=None, world=dist.group.WORLD,
                   control=dist.new_group(backend="gloo"))
    shard, _ = d.dispatch(samples if rank == 0 else None, n)
    return calls, _as_lists(shard)


@pytest.mark.multirank
def test_rank_0_sends_every_replica_its_shard_in_one_batch_of_point_to_point_ops():
    """Issue 42, finding 6. Under NCCL each lone send/recv pair builds a 2-rank communicator
    of its own (ProcessGroupNCCL::pointToPoint), dp - 1 of them at the first step; a batch
    of isend/irecv runs on the world's communicator. At DP=3 rank 0 issues one batch (two
    sends), each head one batch (one receive), and no lone send or receive."""
    samples = _samples(6, 2)
    out = run_gloo(_counted_dispatch, 3, samples, 2)
    assert [got for _, got in out] == [_as_lists(RolloutShard.from_samples(p)) for p in split_groups(samples, 2, 3)]
    assert [calls for calls, _ in out] == [[["isend", "isend"]], [["irecv"]], [["irecv"]]]


def test_send_batches_keep_order_and_cut_at_the_byte_bound():
    sends = [(torch.empty(n, dtype=torch.uint8), peer) for peer, n in enumerate((4, 4, 3, 9, 1), start=1)]
    batches = send_batches(sends, 8)
    assert [[peer for _, peer in b] for b in batches] == [[1, 2], [3], [4], [5]]  # 9 > 8 goes alone
    assert [peer for b in send_batches(sends, 1 << 30) for _, peer in b] == [1, 2, 3, 4, 5]
    assert len(send_batches(sends, 1 << 30)) == 1 and send_batches([], 8) == []
