"""Token-mean normalisation across 2 gloo ranks × several micro-batches equals one process."""

import pytest
import torch
import torch.distributed as dist
from _dist import run_gloo

from areal_mcore.algo import normalize, ppo_actor_loss, reduce_ppo_stats
from areal_mcore.packing import allocate_micro_batches, pack

pytestmark = pytest.mark.multirank

N_SEQS = 12


def _global_batch():
    g = torch.Generator().manual_seed(7)
    lengths = torch.randint(3, 40, (N_SEQS,), generator=g).tolist()
    seqs = []
    for n in lengths:
        prompt = int(torch.randint(1, n, (1,), generator=g))
        mask = torch.arange(n) >= prompt
        seqs.append({
            "loss_mask": mask,
            "logprobs": -torch.rand(n, generator=g) * 3,
            "prox": -torch.rand(n, generator=g) * 3,
            "behave": -torch.rand(n, generator=g) * 3,
            "advantages": torch.randn(n, generator=g) * 4,
        })
    return seqs


def _pack_fields(seqs):
    batch = pack([torch.zeros(len(s["loss_mask"]), dtype=torch.long) for s in seqs],
                 {k: [s[k] for s in seqs] for k in seqs[0]})
    return batch.fields


def _loss_kwargs():
    return dict(eps_clip=0.2, eps_clip_high=0.28, c_clip=3.0, behav_imp_weight_cap=2.0)


def _rank_loss(rank, world_size):
    seqs = _global_batch()[rank::world_size]
    group = dist.group.WORLD
    local_tokens = torch.tensor(float(sum(int(s["loss_mask"].sum()) for s in seqs)))
    global_tokens = local_tokens.clone()
    dist.all_reduce(global_tokens, group=group)
    mbs = allocate_micro_batches([len(s["loss_mask"]) for s in seqs], 60)
    total, stats = torch.zeros(()), []
    for mb in mbs:
        f = _pack_fields([seqs[i] for i in mb])
        loss, st = ppo_actor_loss(f["logprobs"], f["prox"], f["advantages"], f["loss_mask"],
                                  num_global_tokens=global_tokens, behave_logprobs_T=f["behave"],
                                  **_loss_kwargs())
        total = total + loss
        stats.append(st)
    dist.all_reduce(total, group=group)
    f = _pack_fields(seqs)
    adv_norm = normalize(f["advantages"], mean_level="batch", std_level="batch",
                         mask=f["loss_mask"], group=group)
    return len(mbs), total.item(), reduce_ppo_stats(stats, group), adv_norm


@pytest.fixture(scope="module")
def dp_results():
    return run_gloo(_rank_loss, 2)


def test_summed_micro_batch_losses_over_ranks_equal_single_process_token_mean(dp_results):
    f = _pack_fields(_global_batch())
    expected, _ = ppo_actor_loss(f["logprobs"], f["prox"], f["advantages"], f["loss_mask"],
                                 num_global_tokens=f["loss_mask"].sum(),
                                 behave_logprobs_T=f["behave"], **_loss_kwargs())
    assert all(n_mbs > 1 for n_mbs, *_ in dp_results), "need several micro-batches per rank"
    for _, total, _, _ in dp_results:
        assert abs(total - expected.item()) <= 1e-6


def test_stats_reduced_over_ranks_equal_single_process_stats(dp_results):
    f = _pack_fields(_global_batch())
    _, st = ppo_actor_loss(f["logprobs"], f["prox"], f["advantages"], f["loss_mask"],
                           num_global_tokens=1, behave_logprobs_T=f["behave"], **_loss_kwargs())
    expected = reduce_ppo_stats([st])
    for _, _, stats, _ in dp_results:
        assert stats == pytest.approx(expected, rel=1e-6)


def test_batch_adv_norm_over_dp_group_equals_single_process(dp_results):
    seqs = _global_batch()
    f = _pack_fields(seqs)
    full = normalize(f["advantages"], mean_level="batch", std_level="batch", mask=f["loss_mask"])
    per_seq = dict(enumerate(torch.split(full, [len(s["loss_mask"]) for s in seqs])))
    for rank, (_, _, _, adv_norm) in enumerate(dp_results):
        expected = torch.cat([per_seq[i] for i in range(rank, N_SEQS, 2)])
        torch.testing.assert_close(adv_norm, expected, atol=1e-6, rtol=1e-6)
