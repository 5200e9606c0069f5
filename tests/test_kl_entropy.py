"""The PPO loss's regularisers: the entropy bonus (``ppo.entropy_coef``) and the KL to a frozen
reference model (``ppo.kl_coef``, ``kl_estimator``, ``kl_in``).

References are written per sequence from the definitions and share no code with
``ppo_actor_loss``: the estimators from Schulman's "Approximating KL divergence" (k1, k2, k3;
GRPO, arXiv 2402.03300, uses k3 in the loss), aggregated as each ``loss_agg_mode`` says, in
float64 on random packed batches. The entropy's gradient runs through the fused logprob
kernel against a float64 log_softmax; under TP=2 against TP=1 in
``test_kernels.py::test_entropy_bonus_gradient_on_tp2_shards_equals_tp1`` (in that file's
gloo fixture). One tiny-actor run loads the reference from the actor's own initial weights.
"""

from pathlib import Path

import pytest
import torch
from _actor_setup import VOCAB, tiny_actor, train_fields
from _actor_setup import seqs as _actor_seqs
from _dist import run_gloo
from _gae_reference import reference_gae

from areal_mcore.actor.logprobs import token_logprobs_entropy
from areal_mcore.algo import ppo_actor_loss, reduce_ppo_stats
from areal_mcore.algo.config import PPOConfig
from areal_mcore.config import ConfigError, load_config
from areal_mcore.packing import pack

BOBA_7B = Path(__file__).parents[1] / "configs" / "boba_7b.yaml"
AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
NORM, ENT_COEF, KL_COEF = 40, 0.03, 0.7


def _batch(seed=0, n_seqs=6):
    """Packed float64 sequences (prompt, then response = loss tokens; one empty response)
    with θ's logprobs and entropies and a reference a few tenths of a nat away."""
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for i in range(n_seqs):
        prompt = int(torch.randint(1, 5, (1,), generator=g))
        n = prompt + (0 if i == 2 else int(torch.randint(1, 12, (1,), generator=g)))
        logp = -torch.rand(n, generator=g, dtype=torch.float64) * 3
        seqs.append({"mask": torch.arange(n) >= prompt, "logp": logp, "prox": logp.clone(),
                     "ref": logp + torch.randn(n, generator=g, dtype=torch.float64) * 0.5,
                     "entropy": torch.rand(n, generator=g, dtype=torch.float64) * 4,
                     "adv": torch.full((n,), float(torch.randn(1, generator=g)), dtype=torch.float64)})
    cat = {k: torch.cat([s[k] for s in seqs]) for k in seqs[0]}
    cu = torch.cumsum(torch.tensor([0] + [len(s["mask"]) for s in seqs]), 0).to(torch.int32)
    return seqs, cat, cu


def _ours(cat, cu, agg, estimator, entropy_coef, kl_coef):
    logp = cat["logp"].clone().requires_grad_()
    ent = cat["entropy"].clone().requires_grad_()
    loss, stats = ppo_actor_loss(
        logp, cat["prox"], cat["adv"], cat["mask"], num_global_tokens=int(cat["mask"].sum()), eps_clip=0.2,
        cu_seqlens_B1=cu, num_global_seqs=5, loss_agg_mode=agg,
        loss_norm_tokens=NORM if agg == "seq-mean-token-sum-norm" else None,
        entropy_T=ent, entropy_coef=entropy_coef, ref_logprobs_T=cat["ref"], kl_coef=kl_coef,
        kl_estimator=estimator)
    loss.backward()
    return loss.detach(), logp.grad, ent.grad, stats


def _k(lp, ref, estimator):
    """KL(π‖π_ref) estimators from samples of π, from the blog post's definitions."""
    log_r = ref - lp  # r = π_ref / π
    return {"k1": -log_r, "k2": 0.5 * log_r**2, "k3": (torch.exp(log_r) - 1) - log_r}[estimator]


def _reference(seqs, agg, estimator):
    """−ENT_COEF · agg(H) + KL_COEF · agg(k), one sequence at a time, and its gradients."""
    G, N = 5, sum(int(s["mask"].sum()) for s in seqs)
    total = torch.zeros((), dtype=torch.float64)
    lps, ents = [], []
    for s in seqs:
        m = s["mask"]
        lp, ent = s["logp"][m].clone().requires_grad_(), s["entropy"][m].clone().requires_grad_()
        lps.append(lp)
        ents.append(ent)
        n = int(m.sum())
        if n == 0:
            continue
        x = KL_COEF * _k(lp, s["ref"][m], estimator) - ENT_COEF * ent
        total = total + {"token-mean": x.sum() / N, "seq-mean-token-mean": x.sum() / n / G,
                         "seq-mean-token-sum": x.sum() / G, "seq-mean-token-sum-norm": x.sum() / NORM / G}[agg]
    total.backward()
    mask = torch.cat([s["mask"] for s in seqs])

    def spread(parts):
        out = torch.zeros(mask.numel(), dtype=torch.float64)
        out[mask] = torch.cat([p.grad if p.grad is not None else torch.zeros_like(p) for p in parts])
        return out

    return total.detach(), spread(lps), spread(ents)


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_entropy_bonus_and_kl_term_equal_the_definitions_for_each_aggregation(agg, estimator):
    seqs, cat, cu = _batch(seed=len(agg) + ord(estimator[1]))
    loss, g_logp, g_ent, _ = _ours(cat, cu, agg, estimator, ENT_COEF, KL_COEF)
    base, g_logp0, g_ent0, _ = _ours(cat, cu, agg, estimator, 0.0, 0.0)
    want, want_g_logp, want_g_ent = _reference(seqs, agg, estimator)
    torch.testing.assert_close(loss - base, want, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(g_logp - g_logp0, want_g_logp, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(g_ent, want_g_ent, atol=1e-12, rtol=1e-10)
    assert g_ent0 is None  # entropy_coef 0: the entropy is not in the graph (its kernel term is skipped)


def test_stats_are_means_over_the_loss_tokens_and_coefficient_zero_changes_nothing():
    seqs, cat, cu = _batch(seed=3)
    loss, _, _, stats = _ours(cat, cu, "token-mean", "k3", 0.0, 0.0)
    plain, _ = ppo_actor_loss(cat["logp"], cat["prox"], cat["adv"], cat["mask"],
                              num_global_tokens=int(cat["mask"].sum()), eps_clip=0.2)
    assert loss == plain  # measured, not added
    out = reduce_ppo_stats([stats])
    m = cat["mask"]
    assert out["entropy"] == pytest.approx(float(cat["entropy"][m].mean()), rel=1e-6)
    assert out["ref_kl"] == pytest.approx(float(_k(cat["logp"][m], cat["ref"][m], "k3").mean()), rel=1e-6)


def test_entropy_gradient_through_the_fused_kernel_matches_float64_log_softmax():
    """The bonus's gradient reaches the logits: aligned logprobs and entropies (0 at each
    sequence's first token), padded vocab columns masked, temperature 0.7."""
    g = torch.Generator().manual_seed(5)
    T, V, vocab, tau = 23, 40, 37, 0.7
    logits = torch.randn(T, V, generator=g, dtype=torch.float64) * 2
    ids = torch.randint(0, vocab, (T,), generator=g)
    cu = torch.tensor([0, 6, 15, T], dtype=torch.int32)
    mask = torch.ones(T, dtype=torch.bool)
    mask[[0, 1, 6, 15, 16]] = False  # prompts
    prox = -torch.rand(T, generator=g, dtype=torch.float64)
    adv = torch.randn(T, generator=g, dtype=torch.float64)

    def loss_of(logp, ent):
        return ppo_actor_loss(logp, prox, adv, mask, num_global_tokens=int(mask.sum()), eps_clip=0.2,
                              cu_seqlens_B1=cu, num_global_seqs=3, loss_agg_mode="seq-mean-token-mean",
                              entropy_T=ent, entropy_coef=0.5)[0]

    x = logits.clone().requires_grad_()
    logp, ent = token_logprobs_entropy(x, ids, cu, vocab_size=vocab, tp_rank=0, tp_group=None,
                                       temperature=tau, kernel="torch")
    loss_of(logp, ent).backward()

    y = logits.clone().requires_grad_()
    logp_TV = (y / tau).masked_fill(torch.arange(V) >= vocab, float("-inf")).log_softmax(-1)
    ent_T = -(logp_TV.exp() * logp_TV.nan_to_num(neginf=0.0)).sum(-1)
    next_T = logp_TV[:-1].gather(1, ids[1:, None]).squeeze(1)
    starts = cu[:-1].long()
    ref_logp = torch.cat([torch.zeros(1, dtype=torch.float64), next_T]).index_fill(0, starts, 0.0)
    ref_ent = torch.cat([torch.zeros(1, dtype=torch.float64), ent_T[:-1]]).index_fill(0, starts, 0.0)
    loss_of(ref_logp, ref_ent).backward()
    torch.testing.assert_close(ent.double(), ref_ent.detach(), atol=1e-5, rtol=1e-5)  # the kernel is fp32
    torch.testing.assert_close(x.grad, y.grad, atol=1e-6, rtol=1e-5)
    assert y.grad.abs().max() > 1e-3 and torch.all(x.grad[:, vocab:] == 0)


# ----------------------------------------------------------------------------- kl_in: reward


@pytest.mark.parametrize("estimator,gamma,lam", [("k3", 1.0, 1.0), ("k1", 0.9, 0.8), ("k2", 1.0, 0.5)])
def test_kl_in_reward_subtracts_the_penalty_from_each_response_tokens_reward_before_gae(estimator, gamma, lam):
    from areal_mcore.trainer.batch import add_advantages

    seqs, cat, cu = _batch(seed=11)
    ppo = PPOConfig(kl_coef=KL_COEF, kl_in="reward", kl_estimator=estimator, discount=gamma, gae_lambda=lam)
    batch = pack([torch.zeros(len(s["mask"]), dtype=torch.long) for s in seqs],
                 {"loss_mask": [s["mask"] for s in seqs], "prox": [s["prox"].float() for s in seqs],
                  "ref": [s["ref"].float() for s in seqs]})
    rewards = torch.randn(len(seqs), generator=torch.Generator().manual_seed(2))
    adv = add_advantages(batch, rewards, ppo).fields["adv"]
    m = cat["mask"]
    penalty = torch.where(m, -KL_COEF * _k(cat["prox"].float().double(), cat["ref"].float().double(), estimator), 0.0)
    want, _ = reference_gae(rewards.tolist(), [len(s["mask"]) for s in seqs], None, m.tolist(), gamma, lam,
                            token_rewards=penalty.tolist())
    torch.testing.assert_close(adv, want.float(), atol=1e-5, rtol=1e-5)
    off = add_advantages(batch, rewards, PPOConfig(discount=gamma, gae_lambda=lam)).fields["adv"]
    assert not torch.allclose(adv, off)


def test_the_regularisers_stay_on_the_actors_device():
    """On a GPU the packed batch is built on the device (from a RolloutShard) and
    compute_logprobs writes ``prox`` and ``ref`` there; θ's logprobs and entropies come off
    the logits there too. The KL penalty, GAE's per-token rewards and the loss terms must
    not bring in a CPU tensor: the emulated device refuses the mix."""
    from _fake_cuda import FakeCuda, is_fake_cuda

    from areal_mcore.trainer.batch import add_advantages
    from areal_mcore.trainer.ppo import ppo_loss

    seqs, cat, cu = _batch(seed=3)
    n_tokens, n_seqs = int(cat["mask"].sum()), len(seqs)
    with FakeCuda():
        batch = pack([torch.zeros(len(s["mask"]), dtype=torch.long) for s in seqs],
                     {"loss_mask": [s["mask"] for s in seqs], "prox": [s["prox"].float() for s in seqs],
                      "ref": [s["ref"].float() for s in seqs],
                      "empty_response": [torch.zeros(len(s["mask"])) for s in seqs]}).to("cuda")
        add_advantages(batch, torch.randn(n_seqs).to("cuda"), PPOConfig(kl_coef=KL_COEF, kl_in="reward"))
        logp = batch.fields["prox"].clone().requires_grad_()
        entropy = torch.rand(logp.shape).to("cuda").requires_grad_()
        loss, stats = ppo_loss(PPOConfig(kl_coef=KL_COEF, entropy_coef=ENT_COEF), 0, logp, batch,
                               torch.tensor(float(n_tokens)).to("cuda"), torch.tensor(float(n_seqs)).to("cuda"),
                               entropy_T=entropy)
        loss.backward()
    assert is_fake_cuda(batch.fields["adv"]) and is_fake_cuda(loss)
    assert is_fake_cuda(stats["ref_kl_sum"]) and is_fake_cuda(stats["entropy_sum"])
    assert logp.grad is not None and entropy.grad is not None  # (autograd's grads carry no device tag)


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize("overrides,match", [
    (["ppo.kl_estimator=k4"], r"ppo\.kl_estimator='k4' is not allowed; choose one of \['k1', 'k2', 'k3'\]"),
    (["ppo.kl_in=advantage"], r"ppo\.kl_in='advantage' is not allowed; choose one of \['loss', 'reward'\]"),
    (["ppo.entropy_coef=-0.1"], r"ppo\.entropy_coef=-0\.1 must be >= 0"),
    (["ppo.kl_coef=-1"], r"ppo\.kl_coef=-1(\.0)? must be >= 0"),
    (["ppo.ref_model_path=/m"], r"ppo\.ref_model_path='/m' is loaded only with kl_coef > 0"),
    (["ppo.kl_coef=0.1", "ppo.kl_in=reward", "ppo.use_decoupled_loss=true", "ppo.prox_logp_method=loglinear"],
     r"ppo\.kl_in='reward' needs prox_logp_method recompute or metrics"),
])
def test_bad_regulariser_options_are_refused_naming_the_key(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(BOBA_7B, overrides)


def test_boba_has_no_regulariser_and_loads_no_reference():
    ppo = load_config(BOBA_7B, []).ppo
    assert (ppo.entropy_coef, ppo.kl_coef, ppo.uses_reference) == (0.0, 0.0, False)


# ----------------------------------------------------------------------------- tiny actor


def _reference_worker(rank, world):
    from _tiny_model import tiny_qwen2

    actor = tiny_actor()
    ref = actor.build_frozen_model(tiny_qwen2(vocab=VOCAB)[1])  # the actor's own initial weights
    s = _actor_seqs()
    batch = pack(s, train_fields(s))
    batch.fields["ref"] = actor.compute_logprobs(batch, model=ref)
    out = {"ref_equals_actor": torch.equal(batch.fields["ref"], actor.compute_logprobs(batch)),
           "ref_params_frozen": not any(p.requires_grad for p in ref.parameters())}

    def loss_fn(logp, mb, n_tok, n_seq, *, entropy_T):
        f = mb.fields
        kw = dict(num_global_tokens=n_tok, eps_clip=0.2, entropy_T=entropy_T, entropy_coef=0.01,
                  ref_logprobs_T=f["ref"], kl_estimator="k3")
        loss, stats = ppo_actor_loss(logp, f["prox"], f["adv"], f["loss_mask"], kl_coef=0.5, **kw)
        plain, _ = ppo_actor_loss(logp, f["prox"], f["adv"], f["loss_mask"], kl_coef=0.0, **kw)
        return loss, {**stats, "kl_term": (loss - plain).detach()}

    result = actor.train_batch(batch, loss_fn, n_minibatches=2, entropy=True)
    n1, stats = result["n_micro_batches"][0], result["micro_stats"]
    out["kl_first"] = float(sum(x["ref_kl_sum"] for x in stats[:n1]))  # before any optimizer step
    out["kl_term_first"] = float(sum(x["kl_term"] for x in stats[:n1]))
    out["kl_second"] = float(sum(x["ref_kl_sum"] for x in stats[n1:]))  # after one
    out["entropy"] = float(sum(x["entropy_sum"] for x in stats))
    out["ref_unchanged"] = torch.equal(batch.fields["ref"], actor.compute_logprobs(batch, model=ref))
    return out


def test_reference_from_the_initial_weights_gives_kl_zero_then_positive_after_a_step():
    out = run_gloo(_reference_worker, 1)[0]
    assert out["ref_equals_actor"] and out["ref_params_frozen"] and out["ref_unchanged"]
    assert abs(out["kl_first"]) < 1e-9 and abs(out["kl_term_first"]) < 1e-9
    assert out["kl_second"] > 1e-6 and out["entropy"] > 0


def test_plan_counts_the_reference_models_weights_on_every_trainer_rank():
    from areal_mcore.plan import make_plan

    off = make_plan(load_config(BOBA_7B, []), with_fixes=False)
    on = make_plan(load_config(BOBA_7B, ["ppo.kl_coef=0.001"]), with_fixes=False)
    for a, b in zip(off.trainer, on.trainer, strict=True):
        assert a.terms["ref_weights"] == 0 and b.terms["ref_weights"] == b.terms["weights"] > 0
        assert b.total - a.total == b.terms["weights"]


def test_a_reference_of_another_architecture_is_refused_before_start(tmp_path):
    import json

    from areal_mcore.paths import PathError, check_same_architecture

    shape = {"model_type": "qwen2", "vocab_size": 250, "hidden_size": 64, "num_hidden_layers": 4}
    for name, layers in (("actor", 4), ("same", 4), ("deeper", 6)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({**shape, "num_hidden_layers": layers}))
    check_same_architecture("ppo.ref_model_path", str(tmp_path / "same"), "model_path", str(tmp_path / "actor"))
    with pytest.raises(PathError, match=r"ppo\.ref_model_path=.*num_hidden_layers: 6 vs 4"):
        check_same_architecture("ppo.ref_model_path", str(tmp_path / "deeper"), "model_path", str(tmp_path / "actor"))
