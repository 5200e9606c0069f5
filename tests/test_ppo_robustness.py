"""PPO training on legal but awkward inputs, through the real actor on gloo: fewer sequences
than minibatches on a DP rank, empty responses, −inf/NaN rollout logprobs, a NaN loss."""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch
from _actor_setup import VOCAB, tiny_actor
from _dist import run_gloo

from areal_mcore.algo.config import NormConfig, PPOConfig
from areal_mcore.rollout.trajectory import Sample

PPO = PPOConfig(ppo_n_minibatches=4, reward_bias=-0.5, reward_scaling=10.0, use_decoupled_loss=True,
                behav_imp_weight_cap=5.0, adv_norm=NormConfig(mean_level="batch", std_level="none"))


def _samples(n_out=(5, 0, 7), seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, k in enumerate(n_out):
        out.append(Sample(group=i, prompt_ids=torch.randint(0, VOCAB, (4,), generator=g).tolist(),
                          output_ids=torch.randint(0, VOCAB, (k,), generator=g).tolist(),
                          logprobs=(-torch.rand(k, generator=g) * 4).tolist(), versions=[0] * k,
                          reward=float(i == 0), finish_reason="stop" if k else "abort", start_version=0))
    return out


def _train(actor, batch, step, **ppo_kw):
    from areal_mcore.algo import reduce_ppo_stats
    from areal_mcore.trainer.ppo import ppo_loss

    ppo = PPOConfig(**{**PPO.__dict__, **ppo_kw})
    batch.fields["prox"] = actor.compute_logprobs(batch)
    return actor.train_batch(batch, partial(ppo_loss, ppo, step), ppo.ppo_n_minibatches,
                             reduce_stats=reduce_ppo_stats, step=step)


def _params(actor):
    return [p.detach().clone() for p in actor.model.module.parameters()]


def _dp_worker(rank, world):
    from areal_mcore.trainer.batch import to_train_batch

    actor = tiny_actor()
    dp = actor.groups.dp
    mine = _samples()[rank::world]  # rank 0: samples 0 and 2, rank 1: sample 1 (empty response)
    out = {"first": _train(actor, to_train_batch(mine, PPO, dp_group=dp), step=1)}
    # A NaN advantage on one rank: every rank raises, naming the step and the minibatch,
    # and the optimizer does not step.
    batch = to_train_batch(mine, PPO, dp_group=dp)
    if rank == 0:
        batch.fields["adv"][batch.fields["loss_mask"]] = float("nan")
    before = _params(actor)
    try:
        _train(actor, batch, step=2)
        out["nan_error"] = None
    except FloatingPointError as e:
        out["nan_error"] = str(e)
    out["unchanged"] = all(torch.equal(a, b) for a, b in zip(before, _params(actor)))
    # One sample in all: rank 1 has none, and still trains (placeholders) with rank 0.
    # (mean none / std batch: one sample's advantages keep their sign, and the empty rank
    # joins the all-reduce with nothing.)
    one, rms = _samples()[:1][rank::world], NormConfig(mean_level="none", std_level="batch")
    ppo = PPOConfig(**{**PPO.__dict__, "adv_norm": rms})
    out["alone"] = _train(actor, to_train_batch(one, ppo, dp_group=dp), step=3, adv_norm=rms)
    return out


@pytest.fixture(scope="module")
def dp_results():
    return run_gloo(_dp_worker, 2)


@pytest.mark.multirank
def test_dp2_with_three_sequences_and_four_minibatches_trains_and_counts_the_empty_response(dp_results):
    (r0, r1) = (r["first"] for r in dp_results)
    assert r0["loss"] == r1["loss"] and len(r0["loss"]) == 4
    assert all(math.isfinite(x) for x in r0["loss"] + r0["grad_norm"])
    # minibatch 1: sample 0 (rank 0) + the empty response (rank 1); 2: sample 2 (rank 0) and a
    # placeholder (rank 1); 3, 4: placeholders everywhere, which train nothing.
    assert r0["grad_norm"][0] > 0 and r0["grad_norm"][1] > 0
    assert r0["grad_norm"][2:] == [0.0, 0.0] and r0["loss"][2:] == [0.0, 0.0]
    assert r0["stats"]["loss_tokens"] == 5 + 7
    assert r0["stats"]["empty_responses"] == 1 and r1["stats"] == r0["stats"]


@pytest.mark.multirank
def test_a_nan_loss_raises_on_every_rank_naming_step_and_minibatch_before_the_optimizer_steps(dp_results):
    for r in dp_results:
        assert r["nan_error"] is not None and "step 2, minibatch 1/4" in r["nan_error"]
        assert r["unchanged"]


def _nonfinite_worker(rank, world):
    """One step with −inf and NaN rollout logprobs vs the same step with those tokens
    dropped by the cap (a finite behave far below prox): same normaliser, same kept tokens."""
    from areal_mcore.trainer.batch import to_train_batch

    samples = _samples((6, 5, 7), seed=1)
    samples[0].logprobs[2] = -math.inf
    samples[2].logprobs[4] = math.nan
    capped = _samples((6, 5, 7), seed=1)
    capped[0].logprobs[2] = capped[2].logprobs[4] = -1e4  # exp(prox + 1e4) > cap: dropped
    results = []
    for s in (samples, capped):
        actor = tiny_actor()
        r = _train(actor, to_train_batch(s, PPO), step=1, ppo_n_minibatches=1)
        results.append((r, _params(actor)))
    return results


def test_minus_inf_and_nan_rollout_logprobs_give_the_gradient_of_those_tokens_masked_out():
    (bad, bad_params), (ref, ref_params) = run_gloo(_nonfinite_worker, 1)[0]
    assert all(math.isfinite(x) for x in bad["loss"] + bad["grad_norm"])
    assert bad["loss"] == ref["loss"] and bad["grad_norm"] == ref["grad_norm"]
    assert all(torch.equal(a, b) for a, b in zip(bad_params, ref_params))
    assert bad["stats"]["behav_dropped_ratio"] == pytest.approx(2 / 18)
    assert bad["stats"]["nonfinite_ratio"] == pytest.approx(2 / 18)
    assert ref["stats"]["cap_masked_ratio"] == pytest.approx(2 / 18)
    assert math.isfinite(bad["stats"]["behav_imp_weight_max"])


@pytest.mark.multirank
def test_a_dp_rank_without_any_sample_takes_part_with_zero_loss_tokens(dp_results):
    (r0, r1) = (r["alone"] for r in dp_results)
    assert r0["loss"] == r1["loss"] and r0["grad_norm"] == r1["grad_norm"]
    assert r0["grad_norm"][0] > 0 and r0["grad_norm"][1:] == [0.0, 0.0, 0.0]
    assert r0["stats"]["loss_tokens"] == 5 and r0["stats"]["empty_responses"] == 0


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.server
def test_the_ppo_loop_on_dp2_with_three_sequences_and_three_minibatches(tmp_path):
    from test_ppo_e2e import _overrides, _ppo_worker

    from areal_mcore.data.tiny_assets import TinyAssetsConfig, build_tiny_assets

    assets = build_tiny_assets(TinyAssetsConfig(out_dir=str(tmp_path / "assets"), n_train=16, n_test=4,
                                                hidden_size=32, intermediate_size=64, num_layers=1))
    overrides = _overrides(assets, tmp_path, "dp2", "actor.optimizer.lr=1e-4", "rollout.max_new_tokens=8",
                           "rollout.n_samples=1", "trainer.batch_size=3", "ppo.ppo_n_minibatches=3",
                           "server.context_length=256", "trainer.total_steps=1", "ppo.reward_bias=-0.5",
                           "ppo.reward_scaling=10.0", "ppo.adv_norm.mean_level=none", "ppo.adv_norm.std_level=batch")
    rank0, rank1 = run_gloo(_ppo_worker, 2, overrides)
    (row,) = rank0
    assert row["rollout/n_samples"] == 3 and len(row["train/loss"]) == 3
    assert row["train/loss"] == rank1[0]["train/loss"]
    assert all(math.isfinite(x) for x in row["train/loss"] + row["train/grad_norm"])
    # Rank 0 holds 2 sequences, rank 1 one: the third minibatch is empty on both ranks.
    # (ppo_n_minibatches above the batch's 3 samples is refused: test_paths.)
    assert row["train/grad_norm"][2:] == [0.0]
