"""The loss menu (``ppo.loss_agg_mode``, ``importance_sampling_level``, behaviour-weight
level and mode) against reference formulas written per sequence from the papers, in float64
on random packed batches; and the aggregation's exactness over micro-batches and ranks.

The references loop over sequences in plain torch and share no code with
``ppo_actor_loss``: DAPO (arXiv 2503.14476) token-mean, GRPO's per-sequence mean, GSPO
(2507.18071) sequence ratio, Dr.GRPO (2503.20783) constant normaliser, TIS (truncated) and
MIS (masked) behaviour weights, per token and per sequence.
"""

import itertools
import math
from pathlib import Path

import pytest
import torch
from _actor_setup import seqs as _actor_seqs
from _actor_setup import tiny_actor, train_fields
from _dist import run_gloo

from areal_mcore.algo import ppo_actor_loss
from areal_mcore.algo.config import PPOConfig
from areal_mcore.config import ConfigError, load_config

EPS_LOW, EPS_HIGH, CAP, NORM = 0.2, 0.28, 2.0, 50
BOBA_7B = Path(__file__).parents[1] / "configs" / "boba_7b.yaml"


def _batch(seed=0, n_seqs=7):
    """Packed sequences (prompt, then response = loss tokens; one empty response), float64,
    with a per-sequence advantage as GRPO/boba give and logprobs near the proximal ones so
    that some ratios clip and some do not."""
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for i in range(n_seqs):
        prompt = int(torch.randint(1, 5, (1,), generator=g))
        response = 0 if i == 3 else int(torch.randint(1, 12, (1,), generator=g))
        n = prompt + response
        prox = -torch.rand(n, generator=g, dtype=torch.float64) * 3
        seqs.append({
            "mask": torch.arange(n) >= prompt,
            "logp": prox + torch.randn(n, generator=g, dtype=torch.float64) * 0.3,
            "prox": prox,
            "behave": prox + torch.randn(n, generator=g, dtype=torch.float64) * 0.4,
            "adv": torch.full((n,), float(torch.randn(1, generator=g)), dtype=torch.float64),
        })
    return seqs


def _packed(seqs):
    cat = {k: torch.cat([s[k] for s in seqs]) for k in seqs[0]}
    lens = torch.tensor([0] + [len(s["mask"]) for s in seqs])
    return cat, torch.cumsum(lens, 0).to(torch.int32)


def _ours(seqs, num_tokens=None, num_seqs=None, decoupled=True, **options):
    """``ppo_actor_loss`` on the packed ``seqs``; returns the loss and d loss / d logp per sequence."""
    f, cu = _packed(seqs)
    logp = f["logp"].clone().requires_grad_()
    n_tok = sum(int(s["mask"].sum()) for s in seqs) if num_tokens is None else num_tokens
    n_seq = sum(int(s["mask"].any()) for s in seqs) if num_seqs is None else num_seqs
    loss, _ = ppo_actor_loss(logp, f["prox"], f["adv"], f["mask"], num_global_tokens=n_tok,
                             eps_clip=EPS_LOW, eps_clip_high=EPS_HIGH,
                             behave_logprobs_T=f["behave"] if decoupled else None,
                             cu_seqlens_B1=cu, num_global_seqs=n_seq, **options)
    loss.backward()
    return loss.detach(), logp.grad


def _reference(seqs, *, agg, is_level="token", w_level="token", w_mode="mask", cap=CAP, decoupled=True):
    """The same loss, one sequence at a time, from the papers' formulas."""
    logp = [s["logp"][s["mask"]].clone().requires_grad_() for s in seqs]
    G = sum(1 for s in seqs if s["mask"].any())
    N = sum(int(s["mask"].sum()) for s in seqs)
    total = torch.zeros((), dtype=torch.float64)
    for s, lp in zip(seqs, logp):
        m = s["mask"]
        n = int(m.sum())
        if n == 0:
            continue
        prox, behave, adv = s["prox"][m], s["behave"][m], s["adv"][m]
        if is_level == "token":
            r = torch.exp(lp - prox)
        else:  # GSPO eq. (7): s_i = (π_θ(y_i|x) / π_old(y_i|x))^(1/|y_i|)
            r = torch.exp((lp.sum() - prox.sum()) / n).expand(n)
        surrogate = torch.minimum(r * adv, r.clamp(1 - EPS_LOW, 1 + EPS_HIGH) * adv)
        if not decoupled:
            w = torch.ones(n, dtype=torch.float64)
        elif w_level == "token":
            w = torch.exp(prox - behave)
        else:
            w = torch.exp((prox - behave).sum()).expand(n)
        if decoupled and cap is not None:
            w = torch.where(w > cap, 0.0 if w_mode == "mask" else cap, w)  # MIS / TIS
        token_losses = -(w * surrogate)
        if agg == "token-mean":  # DAPO eq. (8): 1/Σ|o_i| Σ_i Σ_t
            total = total + token_losses.sum() / N
        elif agg == "seq-mean-token-mean":  # GRPO / GSPO: 1/G Σ_i 1/|o_i| Σ_t
            total = total + token_losses.sum() / n / G
        elif agg == "seq-mean-token-sum":
            total = total + token_losses.sum() / G
        else:  # Dr.GRPO: 1/G Σ_i Σ_t / (constant max length)
            total = total + token_losses.sum() / NORM / G
    total.backward()
    grad = torch.zeros(sum(len(s["mask"]) for s in seqs), dtype=torch.float64)
    grad[torch.cat([s["mask"] for s in seqs])] = torch.cat([
        lp.grad if lp.grad is not None else torch.zeros_like(lp) for lp in logp])
    return total.detach(), grad


AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("is_level", ["token", "sequence"])
def test_loss_and_grad_equal_the_reference_formula_for_each_aggregation_and_ratio_level(agg, is_level):
    seqs = _batch(seed=1)
    loss, grad = _ours(seqs, loss_agg_mode=agg, loss_norm_tokens=NORM, importance_sampling_level=is_level,
                       behav_imp_weight_cap=CAP)
    ref_loss, ref_grad = _reference(seqs, agg=agg, is_level=is_level)
    assert abs(loss.item() - ref_loss.item()) <= 1e-6
    torch.testing.assert_close(grad, ref_grad, atol=1e-6, rtol=0)


@pytest.mark.parametrize("w_level,w_mode", list(itertools.product(["token", "sequence"], ["mask", "truncate"])))
def test_behaviour_weight_level_and_mode_equal_tis_and_mis_references(w_level, w_mode):
    seqs = _batch(seed=2)
    loss, grad = _ours(seqs, loss_agg_mode="seq-mean-token-mean", behav_imp_weight_cap=CAP,
                       behav_imp_weight_level=w_level, behav_imp_weight_mode=w_mode)
    ref_loss, ref_grad = _reference(seqs, agg="seq-mean-token-mean", w_level=w_level, w_mode=w_mode)
    assert abs(loss.item() - ref_loss.item()) <= 1e-6
    torch.testing.assert_close(grad, ref_grad, atol=1e-6, rtol=0)
    # the batch must exercise the cap, or the test proves nothing about the mode
    weights = [torch.exp(s["prox"] - s["behave"])[s["mask"]] for s in seqs]
    if w_level == "sequence":
        weights = [w.prod(0, keepdim=True) for w in weights if len(w)]
    over = torch.cat(weights) > CAP
    assert over.any() and not over.all()


def test_gspo_ratio_gradient_is_the_sequence_ratio_over_its_loss_token_count():
    seqs = _batch(seed=3)[:1]
    seqs[0]["logp"] = seqs[0]["prox"] + 0.01  # inside the clip range: s = e^0.01
    _, grad = _ours(seqs, decoupled=False, loss_agg_mode="seq-mean-token-sum",
                    importance_sampling_level="sequence")
    m, n = seqs[0]["mask"], int(seqs[0]["mask"].sum())
    # loss = -Σ_t A s over |y| tokens, so d/dlogp_t = -A |y| (s / |y|) = -A s on each loss token
    expected = torch.where(m, -seqs[0]["adv"] * math.exp(0.01), 0.0)
    torch.testing.assert_close(grad, expected, atol=1e-12, rtol=0)
    assert n > 1


def test_defaults_are_the_token_mean_loss_unchanged():
    seqs = _batch(seed=4)
    f, cu = _packed(seqs)
    logp = f["logp"].float()
    kw = dict(num_global_tokens=int(f["mask"].sum()), eps_clip=0.2, behave_logprobs_T=f["behave"].float(),
              behav_imp_weight_cap=CAP)
    today, _ = ppo_actor_loss(logp, f["prox"].float(), f["adv"].float(), f["mask"], **kw)
    spelled, _ = ppo_actor_loss(logp, f["prox"].float(), f["adv"].float(), f["mask"], **kw, cu_seqlens_B1=cu,
                                num_global_seqs=7, loss_agg_mode="token-mean", importance_sampling_level="token",
                                behav_imp_weight_level="token", behav_imp_weight_mode="mask")
    assert today.dtype == torch.float32 and torch.equal(today, spelled)


@pytest.mark.parametrize("agg,is_level,w_level,w_mode", [
    ("token-mean", "sequence", "sequence", "truncate"),
    ("seq-mean-token-mean", "sequence", "token", "mask"),
    ("seq-mean-token-sum", "token", "sequence", "mask"),
    ("seq-mean-token-sum-norm", "sequence", "token", "truncate"),
])
def test_two_ranks_of_two_micro_batches_sum_to_the_single_process_loss_and_grad(agg, is_level, w_level, w_mode):
    """What the actor does: each micro-batch normalised by the minibatch's global counts
    (``_plan_minibatch``), losses and gradients summed over micro-batches and DP ranks."""
    seqs = _batch(seed=5, n_seqs=10)
    opts = dict(loss_agg_mode=agg, loss_norm_tokens=NORM, importance_sampling_level=is_level,
                behav_imp_weight_level=w_level, behav_imp_weight_mode=w_mode, behav_imp_weight_cap=CAP)
    whole_loss, whole_grad = _ours(seqs, **opts)
    n_tok = sum(int(s["mask"].sum()) for s in seqs)
    n_seq = sum(int(s["mask"].any()) for s in seqs)
    rank_seqs = [seqs[0::2], seqs[1::2]]  # the dispatcher's interleaving; any split works
    total, grads = torch.zeros((), dtype=torch.float64), {}
    for mine in rank_seqs:
        for mb in (mine[:2], mine[2:]):
            loss, grad = _ours(mb, num_tokens=n_tok, num_seqs=n_seq, **opts)
            total = total + loss
            for s, g in zip(mb, torch.split(grad, [len(s["mask"]) for s in mb])):
                grads[id(s)] = g
    assert abs(total.item() - whole_loss.item()) <= 1e-12
    torch.testing.assert_close(torch.cat([grads[id(s)] for s in seqs]), whole_grad, atol=1e-12, rtol=0)


def test_nonfinite_behaviour_logprob_drops_the_whole_sequence_at_sequence_level():
    seqs = _batch(seed=6)
    seqs[0]["behave"][-1] = -math.inf
    f, cu = _packed(seqs)
    _, stats = ppo_actor_loss(f["logp"], f["prox"], f["adv"], f["mask"], num_global_tokens=1,
                              eps_clip=0.2, behave_logprobs_T=f["behave"], behav_imp_weight_cap=1e9,
                              cu_seqlens_B1=cu, behav_imp_weight_level="sequence")
    assert stats["nonfinite_tokens"].item() == seqs[0]["mask"].sum().item()


def test_sequence_options_without_boundaries_are_refused():
    f, _ = _packed(_batch())
    with pytest.raises(ValueError, match="cu_seqlens_B1"):
        ppo_actor_loss(f["logp"], f["prox"], f["adv"], f["mask"], num_global_tokens=1, eps_clip=0.2,
                       importance_sampling_level="sequence")


# ----------------------------------------------------------------------------- the actor


def _gspo_loss(logp, mb, num_global_tokens, num_global_seqs):
    f = mb.fields
    return ppo_actor_loss(logp, f["prox"], f["adv"], f["loss_mask"], num_global_tokens=num_global_tokens,
                          eps_clip=0.2, cu_seqlens_B1=mb.cu_seqlens_padded, num_global_seqs=num_global_seqs,
                          loss_agg_mode="seq-mean-token-mean", importance_sampling_level="sequence")


def _actor_worker(rank, world):
    """One GSPO step (two minibatches) on the DP ranks' halves of each minibatch; sequence 1
    has no loss token, so a wrong sequence count (local, or counting it) changes the loss."""
    from areal_mcore.packing import pack

    actor = tiny_actor(cap=16)
    g, seqs = actor.groups, _actor_seqs()
    fields = train_fields(seqs)
    fields["loss_mask"][1] = torch.zeros_like(fields["loss_mask"][1])
    n = len(seqs) // 2
    mine = [i for mb in (range(n), range(n, 2 * n)) for i in list(mb)[g.dp_rank::g.dp_size]]
    first = pack(seqs[:n], {k: v[:n] for k, v in fields.items()})
    first_logp = actor.compute_logprobs(first)  # θ before the step: the first minibatch's
    out = actor.train_batch(pack([seqs[i] for i in mine], {k: [v[i] for i in mine] for k, v in fields.items()}),
                            _gspo_loss, n_minibatches=2)
    # The first minibatch's loss by hand: its 3 sequences with loss tokens, not 4, and not 2 per rank.
    f = first.fields
    expected, _ = ppo_actor_loss(first_logp, f["prox"], f["adv"], f["loss_mask"], num_global_tokens=1,
                                 eps_clip=0.2, cu_seqlens_B1=first.cu_seqlens_padded, num_global_seqs=3,
                                 loss_agg_mode="seq-mean-token-mean", importance_sampling_level="sequence")
    return out["loss"], out["n_micro_batches"], actor.hf_state_dict() if g.dp_rank == 0 else {}, float(expected)


@pytest.mark.slow
@pytest.mark.multirank
def test_actor_gspo_seq_mean_step_dp2_equals_single_process():
    (loss, n_mbs, ref, expected), = run_gloo(_actor_worker, 1)
    assert all(n > 1 for n in n_mbs), "need several micro-batches"
    assert loss[0] == pytest.approx(expected, rel=1e-5)
    for rank_loss, rank_mbs, hf, _ in run_gloo(_actor_worker, 2):
        assert rank_loss == pytest.approx(loss, rel=1e-5) and all(n > 1 for n in rank_mbs)
        for name, w in hf.items():
            assert (w - ref[name]).abs().max() <= 1e-5 * ref[name].abs().max(), name


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize("key", ["loss_agg_mode", "importance_sampling_level", "behav_imp_weight_level",
                                 "behav_imp_weight_mode"])
def test_unknown_option_value_is_refused_naming_key_and_choices(key):
    with pytest.raises(ConfigError, match=rf"ppo\.{key}='bogus' is not allowed; choose one of \["):
        load_config(BOBA_7B, [f"ppo.{key}=bogus"])


@pytest.mark.parametrize("overrides,match", [
    (["ppo.behav_imp_weight_mode=truncate", "ppo.behav_imp_weight_cap=null"], "needs behav_imp_weight_cap"),
    (["ppo.behav_imp_weight_level=sequence", "ppo.behav_imp_weight_cap=null"], "needs behav_imp_weight_cap"),
    (["ppo.behav_imp_weight_mode=truncate", "ppo.use_decoupled_loss=false"], "needs use_decoupled_loss"),
    (["ppo.behav_imp_weight_level=sequence", "ppo.use_decoupled_loss=false"], "needs use_decoupled_loss"),
    (["ppo.loss_norm_tokens=100"], "used only by loss_agg_mode=seq-mean-token-sum-norm"),
])
def test_combinations_without_meaning_are_refused_with_the_reason(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(BOBA_7B, ["ppo.use_decoupled_loss=true", "ppo.behav_imp_weight_cap=5", *overrides])


def test_dr_grpo_normaliser_follows_rollout_max_new_tokens_unless_set():
    cfg = load_config(BOBA_7B, ["ppo.loss_agg_mode=seq-mean-token-sum-norm"])
    assert cfg.ppo.loss_norm_tokens == cfg.rollout.max_new_tokens
    cfg = load_config(BOBA_7B, ["ppo.loss_agg_mode=seq-mean-token-sum-norm", "ppo.loss_norm_tokens=100"])
    assert cfg.ppo.loss_norm_tokens == 100
    assert load_config(BOBA_7B, []).ppo.loss_norm_tokens is None  # boba's config is untouched


def test_boba_defaults_are_todays_loss():
    ppo = PPOConfig()
    assert (ppo.loss_agg_mode, ppo.importance_sampling_level, ppo.behav_imp_weight_level,
            ppo.behav_imp_weight_mode) == ("token-mean", "token", "token", "mask")


# ----------------------------------------------------------------------------- proximal methods


def _trainer_mb(seed=7):
    """A packed micro-batch as ``to_train_batch`` builds it (prompt tokens: version −1),
    with recomputed ``prox``; the proximal version is 6, tokens 0 to 6 versions stale."""
    from areal_mcore.packing import pack

    g = torch.Generator().manual_seed(seed)
    seqs, fields = [], {k: [] for k in ("loss_mask", "prox", "behave", "versions", "adv", "empty_response")}
    for v in (6, 5, 4, 3, 2, 0):
        n = 6
        mask = torch.arange(n) >= 2
        fields["loss_mask"].append(mask)
        fields["prox"].append(-torch.rand(n, generator=g) * 2)
        fields["behave"].append(torch.where(mask, -torch.rand(n, generator=g) * 2, 0.0))
        fields["versions"].append(torch.where(mask, v, -1))
        fields["adv"].append(torch.full((n,), float(torch.randn(1, generator=g))))
        fields["empty_response"].append(torch.zeros(n))
        seqs.append(torch.zeros(n, dtype=torch.long))
    return pack(seqs, fields)


def _trainer_loss(method, mb, logp, **options):
    from areal_mcore.trainer.ppo import ppo_loss

    ppo = PPOConfig(use_decoupled_loss=True, behav_imp_weight_cap=5.0, prox_logp_method=method, **options)
    n_tok = mb.fields["loss_mask"].sum()
    return ppo_loss(ppo, 6, logp, mb, n_tok, torch.tensor(6.0))


@pytest.mark.parametrize("options", [
    dict(loss_agg_mode="seq-mean-token-sum-norm", loss_norm_tokens=9),
    dict(importance_sampling_level="sequence"),
    dict(behav_imp_weight_level="sequence", behav_imp_weight_mode="truncate"),
])
def test_the_trainers_loss_hands_each_config_option_to_ppo_actor_loss(options):
    mb = _trainer_mb()
    f = mb.fields
    logp = f["prox"] + 0.3 * torch.randn(len(f["prox"]), generator=torch.Generator().manual_seed(2))
    loss, _ = _trainer_loss("recompute", mb, logp, **options)
    expected, _ = ppo_actor_loss(logp, f["prox"], f["adv"], f["loss_mask"], num_global_tokens=f["loss_mask"].sum(),
                                 eps_clip=0.2, behave_logprobs_T=f["behave"], behav_imp_weight_cap=5.0,
                                 cu_seqlens_B1=mb.cu_seqlens_padded, num_global_seqs=6.0, **options)
    default, _ = _trainer_loss("recompute", mb, logp)
    assert torch.equal(loss, expected) and not torch.equal(loss, default)


def test_reuse_train_logp_takes_thetas_logprobs_as_proximal_so_only_the_behaviour_weight_corrects():
    mb = _trainer_mb()
    f = mb.fields
    logp = (f["prox"] + 0.05).requires_grad_()
    loss, _ = _trainer_loss("reuse_train_logp", mb, logp)
    loss.backward()
    m = f["loss_mask"]
    w = torch.exp(logp.detach() - f["behave"])
    w = torch.where(w > 5.0, 0.0, w)  # MIS: ratio is 1, so the loss is -A w, its gradient -A w
    n = m.sum()
    assert loss.item() == pytest.approx(float(-(f["adv"] * w)[m].sum() / n), abs=1e-6)
    torch.testing.assert_close(logp.grad, torch.where(m, -f["adv"] * w / n, 0.0), atol=1e-6, rtol=0)


def test_metrics_trains_as_recompute_and_measures_the_loglinear_gap_by_staleness():
    from areal_mcore.algo import reduce_ppo_stats

    mb = _trainer_mb()
    f = mb.fields
    logp = f["prox"] + 0.3 * torch.randn(len(f["prox"]), generator=torch.Generator().manual_seed(1))
    loss, stats = _trainer_loss("metrics", mb, logp)
    ref_loss, ref_stats = _trainer_loss("recompute", mb, logp)
    assert torch.equal(loss, ref_loss) and "loglinear_gap_sum" not in ref_stats
    summary = reduce_ppo_stats([stats])
    # by hand: a token k versions stale gets α = k / (k + 1) (ours), loglinear = behave + α (θ − behave)
    gaps = {}
    for t in torch.nonzero(f["loss_mask"]).flatten().tolist():
        k = 6 - int(f["versions"][t])
        alpha = k / (k + 1)
        approx = float(f["behave"][t]) + alpha * (float(logp[t]) - float(f["behave"][t]))
        gaps.setdefault(min(k, 4), []).append(abs(float(f["prox"][t]) - approx))
    every = [x for v in gaps.values() for x in v]
    assert summary["loglinear_gap_mean"] == pytest.approx(sum(every) / len(every), rel=1e-5)
    assert summary["loglinear_gap_max"] == pytest.approx(max(every), rel=1e-5)
    for k, v in gaps.items():
        label = f"{k}plus" if k == 4 else f"{k}"
        assert summary[f"loglinear_gap_mean_stale{label}"] == pytest.approx(sum(v) / len(v), rel=1e-5)
    assert len(gaps[4]) == 8  # 4 and 6 versions stale share the last bucket


@pytest.mark.parametrize("method", ["metrics", "reuse_train_logp"])
def test_proximal_methods_without_the_decoupled_loss_are_refused(method):
    with pytest.raises(ValueError, match=f"prox_logp_method='{method}' needs use_decoupled_loss=true"):
        PPOConfig(prox_logp_method=method)
