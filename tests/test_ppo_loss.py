import math

import pytest
import torch

from areal_mcore.algo import loglinear_proximal_logprobs, ppo_actor_loss, reduce_ppo_stats


def _loss(ratios, adv, mask, **kw):
    logp = torch.tensor(ratios, dtype=torch.float64).log().float().requires_grad_()
    prox = torch.zeros(len(ratios))
    kw.setdefault("num_global_tokens", sum(mask))
    kw.setdefault("eps_clip", 0.2)
    loss, stats = ppo_actor_loss(logp, prox, torch.tensor(adv, dtype=torch.float32),
                                 torch.tensor(mask, dtype=torch.bool), **kw)
    return loss, stats, logp


def test_clipped_loss_matches_hand_computation_and_ignores_masked_tokens():
    # t0: A=1, r=1.5 -> clipped to 1.2 -> -1.2; t1: A=-1, r=0.5 -> max(0.5, 0.8) = 0.8
    # t2: A=2, r=1.1 -> -2.2 (inside the clip range); t3 masked out.
    loss, stats, logp = _loss([1.5, 0.5, 1.1, 3.0], [1.0, -1.0, 2.0, 7.0], [1, 1, 1, 0])
    assert loss.item() == pytest.approx((-1.2 + 0.8 - 2.2) / 3, abs=1e-6)
    assert stats["clipped_tokens"].item() == 2 and stats["loss_tokens"].item() == 3
    loss.backward()
    # Clipped and masked tokens get no gradient; t2: d(-A r)/dlogp / N = -2 * 1.1 / 3.
    torch.testing.assert_close(logp.grad, torch.tensor([0.0, 0.0, -2.2 / 3, 0.0]))


def test_global_token_count_sets_the_normaliser():
    loss, _, _ = _loss([1.0, 1.0], [1.0, 3.0], [1, 1], num_global_tokens=8)
    assert loss.item() == pytest.approx(-4.0 / 8)


def test_asymmetric_clip_uses_eps_clip_high_above_one():
    loss, stats, _ = _loss([1.25, 0.75, 1.22], [1.0, -1.0, 1.0], [1, 1, 1], eps_clip_high=0.28)
    # t0: 1.25 < 1.28, unclipped -> -1.25; t1: 0.75 < 0.8 -> clipped at 0.8 -> 0.8; t2:
    # 1.22, unclipped -> -1.22. (With the bounds crossed, [0.72, 1.2], t0 and t2 clip at
    # 1.2 and t1 does not: without t2 the two losses were equal, -0.225.)
    assert loss.item() == pytest.approx((-1.25 + 0.8 - 1.22) / 3, abs=1e-6)
    assert stats["clipped_tokens"].item() == 1


def test_dual_clip_caps_the_loss_of_negative_advantages():
    # A=-1, r=5 -> max(5, 1.2) = 5, dual clip c=3 -> 3; A=-1, r=2 -> 2 (< 3, untouched);
    # A=+1, r=5 -> clipped -1.2, dual clip never applies to positive advantages.
    loss, stats, _ = _loss([5.0, 2.0, 5.0], [-1.0, -1.0, 1.0], [1, 1, 1], c_clip=3.0)
    assert loss.item() == pytest.approx((3.0 + 2.0 - 1.2) / 3, abs=1e-6)
    assert stats["dual_clipped_tokens"].item() == 1


def test_decoupled_loss_weights_by_behaviour_ratio_and_masks_above_cap():
    logp = torch.zeros(4, requires_grad=True)
    prox = torch.zeros(4)
    behave = -torch.log(torch.tensor([1.0, 2.0, 6.0, 0.5]))  # weights exp(prox - behave)
    adv = torch.tensor([1.0, 1.0, 1.0, -2.0])
    mask = torch.tensor([1, 1, 1, 1], dtype=torch.bool)
    loss, stats = ppo_actor_loss(logp, prox, adv, mask, num_global_tokens=4, eps_clip=0.2,
                                 behave_logprobs_T=behave, behav_imp_weight_cap=5.0)
    # ratio = 1 everywhere; weights 1, 2, (6 > cap: dropped), 0.5; the dropped token still
    # counts in the normaliser (AReaL's behaviour).
    assert loss.item() == pytest.approx((-1.0 - 2.0 + 0.0 + 2.0 * 0.5) / 4, abs=1e-6)
    assert stats["cap_masked_tokens"].item() == 1
    summary = reduce_ppo_stats([stats])
    assert summary["cap_masked_ratio"] == pytest.approx(0.25)
    assert summary["behav_dropped_ratio"] == pytest.approx(0.25)
    # weight stats over the kept tokens only
    assert summary["behav_imp_weight_max"] == pytest.approx(2.0)
    assert summary["behav_imp_weight_mean"] == pytest.approx((1 + 2 + 0.5) / 3)


def test_approx_kl_is_k1_like_areal_with_k3_beside_it():
    _, on, _ = _loss([1.0, 1.0], [1.0, 1.0], [1, 1])
    _, off, _ = _loss([1.3, 0.6], [1.0, 1.0], [1, 1])
    assert on["approx_kl_sum"].item() == 0.0 and on["approx_kl_k3_sum"].item() == 0.0
    assert off["approx_kl_sum"].item() == pytest.approx(math.log(1.3) + math.log(0.6), rel=1e-5)
    k3 = sum(r - 1 - math.log(r) for r in (1.3, 0.6))
    assert off["approx_kl_k3_sum"].item() == pytest.approx(k3, rel=1e-5)
    assert reduce_ppo_stats([off])["approx_kl"] == pytest.approx((math.log(1.3) + math.log(0.6)) / 2, rel=1e-5)


def _policy_grads(behave, loss_mask, num_global_tokens, prox=None):
    """Gradient of the decoupled loss w.r.t. the weights of a tiny linear policy."""
    torch.manual_seed(0)
    policy = torch.nn.Linear(4, 5)
    x, tokens = torch.randn(6, 4), torch.tensor([0, 1, 2, 3, 4, 0])
    logp = torch.log_softmax(policy(x), -1).gather(1, tokens[:, None]).squeeze(1)
    prox = logp.detach() - 0.1 if prox is None else prox
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0, -0.3, 1.0])
    loss, stats = ppo_actor_loss(logp, prox, adv, loss_mask, num_global_tokens=num_global_tokens,
                                 eps_clip=0.2, behave_logprobs_T=behave, behav_imp_weight_cap=5.0)
    loss.backward()
    return loss, [p.grad.clone() for p in policy.parameters()], stats


def test_nonfinite_behaviour_logprobs_are_dropped_and_grads_equal_those_with_the_tokens_masked_out():
    behave = torch.tensor([-1.0, -float("inf"), -1.5, float("nan"), -100.0, -0.7])
    mask = torch.ones(6, dtype=torch.bool)
    loss, grads, stats = _policy_grads(behave, mask, 6)
    assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads)
    # tokens 1 (-inf), 3 (NaN) and 4 (weight e^99 > cap) are dropped
    keep = torch.tensor([1, 0, 1, 0, 0, 1], dtype=torch.bool)
    ref_loss, ref_grads, _ = _policy_grads(torch.where(keep, behave, 0.0), keep, 6)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=0, atol=0)
    summary = reduce_ppo_stats([stats])
    assert summary["behav_dropped_ratio"] == pytest.approx(3 / 6)
    assert summary["nonfinite_ratio"] == pytest.approx(2 / 6) and summary["cap_masked_ratio"] == pytest.approx(1 / 6)
    assert math.isfinite(summary["behav_imp_weight_max"]) and math.isfinite(summary["behav_imp_weight_mean"])


def test_a_nan_loglinear_proximal_from_a_minus_inf_rollout_logprob_is_dropped():
    behave = torch.tensor([-1.0, -float("inf"), -2.0])
    versions = torch.tensor([2, 2, 3])
    logp = torch.tensor([-0.5, -0.8, -1.0], requires_grad=True)
    prox = loglinear_proximal_logprobs(behave, logp, versions, proximal_version=3)
    assert torch.isnan(prox[1])  # -inf + 1/2 * (x - -inf)
    loss, stats = ppo_actor_loss(logp, prox, torch.ones(3), torch.ones(3, dtype=torch.bool), num_global_tokens=3,
                                 eps_clip=0.2, behave_logprobs_T=behave, behav_imp_weight_cap=5.0)
    loss.backward()
    assert torch.isfinite(logp.grad).all() and logp.grad[1] == 0 and stats["dropped_tokens"].item() == 1


def test_loglinear_proximal_logprobs_interpolates_by_version_with_our_labels():
    behave = torch.tensor([-2.0, -2.0, -2.0, -2.0])
    current = torch.tensor([-1.0, -1.0, -1.0, -1.0], requires_grad=True)
    versions = torch.tensor([3, 4, -1, 1])
    prox = loglinear_proximal_logprobs(behave, current, versions, proximal_version=4)
    # alpha = (4 - v) / (5 - v): v=3 -> 1/2, v=4 (on-policy) -> 0, prompt -> 0, v=1 -> 3/4.
    # (AReaL's labels, v_theta = 4 and v_prox = 3, would give 0, -, 0, 2/3.)
    torch.testing.assert_close(prox, torch.tensor([-1.5, -2.0, -2.0, -1.25]))
    assert not prox.requires_grad
