"""The (decoupled) clipped PPO actor loss on packed per-token tensors, and its stats.

Shape legend: T = packed tokens, B = sequences, B1 = B + 1 boundaries. All tensors are
aligned per token; ``loss_mask_T`` marks the tokens that count.

Three policies (AReaL's decoupled PPO): behave (generated the tokens, maybe stale),
proximal (the weights at the start of this PPO step) and θ (being trained). The clipped
ratio is θ / proximal; the behaviour weight exp(prox − behave) corrects for staleness.
Tokens whose weight exceeds ``behav_imp_weight_cap``, or whose proximal logprob or log-
weight is not finite (a −inf or NaN rollout logprob, a NaN interpolated proximal), are
*dropped*: they get weight 0 and a harmless ratio before any product, so neither the
loss nor its gradient can see them (0 · inf in a backward pass is NaN), and they are
counted (``behav_dropped_ratio``). They still count in the normaliser, as AReaL's capped
tokens do. AReaL maps a non-finite log-weight to weight 1 and keeps the token; we drop
it, since a rollout logprob of −inf or NaN means the sample's record is broken.
The loss is a sum divided by the global loss-token count (or, for the ``seq-mean-*``
aggregations, a sum of per-sequence terms divided by the global count of sequences with
loss tokens), so micro-batch losses summed over micro-batches and data-parallel ranks are
exactly the loss of the whole batch held by one process. Sequence-level options (GSPO's
ratio, a per-sequence behaviour weight, TIS truncation): ``ppo_actor_loss``'s docstring.
Logged ratios (clip, KL, behaviour weight) are over the kept tokens.
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.distributed as dist

from areal_mcore import collectives
from areal_mcore.algo.kl import KL_ESTIMATORS, kl_estimate

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
IS_LEVELS = ("token", "sequence")
BEHAV_WEIGHT_MODES = ("mask", "truncate")


def ppo_actor_loss(
    logprobs_T: torch.Tensor,
    proximal_logprobs_T: torch.Tensor,
    advantages_T: torch.Tensor,
    loss_mask_T: torch.Tensor,
    *,
    num_global_tokens: int | float | torch.Tensor,
    eps_clip: float,
    eps_clip_high: float | None = None,
    c_clip: float | None = None,
    behave_logprobs_T: torch.Tensor | None = None,
    behav_imp_weight_cap: float | None = None,
    cu_seqlens_B1: torch.Tensor | None = None,
    num_global_seqs: int | float | torch.Tensor | None = None,
    loss_agg_mode: str = "token-mean",
    loss_norm_tokens: int | None = None,
    importance_sampling_level: str = "token",
    behav_imp_weight_level: str = "token",
    behav_imp_weight_mode: str = "mask",
    entropy_T: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    ref_logprobs_T: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    seq_group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped PPO loss of one micro-batch and its token-summed stats.

    Conventions (sequence i of the packed batch, y_i its loss tokens, |y_i| their count,
    not the packed length; ℓ_t the per-token loss below; G = ``num_global_seqs``, the
    sequences with at least one loss token in the whole batch over all DP ranks; N =
    ``num_global_tokens``):

    - ratio r_t = exp(logp_t − prox_t) (``importance_sampling_level="token"``), or GSPO's
      s_i = exp(mean_{t∈y_i} logp_t − sg(mean_{t∈y_i} prox_t)) for every token of sequence
      i (``"sequence"``, arXiv 2507.18071), so ∂s_i/∂logp_t = s_i/|y_i|; clipped like r_t
      (at sequence level: one value per sequence). Dropped tokens (below) are left out of
      the mean, which is over |y_i| when none is.
    - ℓ_t = w_t · max(−A_t r, −A_t clip(r, 1 − eps_clip, 1 + eps_clip_high)), dual-clipped
      at −A_t c_clip for A_t < 0. The behaviour weight w multiplies the clipped loss (as
      AReaL's decoupled loss does); it is not folded into the ratio before clipping.
    - w_t = exp(prox_t − behave_t) (``behav_imp_weight_level="token"``), or one weight per
      sequence w_i = exp(Σ_{t∈y_i} (prox_t − behave_t)), the product of its tokens'
      weights over loss tokens only (``"sequence"``). Above ``behav_imp_weight_cap``:
      ``behav_imp_weight_mode="mask"`` drops the token (the whole sequence at sequence
      level: MIS, today's rule), ``"truncate"`` uses min(w, cap) (TIS). Non-finite
      weights or proximal logprobs always drop (at sequence level, the whole sequence).
    - aggregation (``loss_agg_mode``), exact over micro-batches and DP ranks:
      ``token-mean`` Σ_t ℓ_t / N (DAPO 2503.14476, boba today);
      ``seq-mean-token-mean`` Σ_i (Σ_{t∈y_i} ℓ_t / |y_i|) / G (GRPO, GSPO);
      ``seq-mean-token-sum`` Σ_i Σ_{t∈y_i} ℓ_t / G;
      ``seq-mean-token-sum-norm`` Σ_i (Σ_{t∈y_i} ℓ_t / ``loss_norm_tokens``) / G (Dr.GRPO
      2503.20783, the paper's form with the 1/G; verl's ``agg_loss`` omits the 1/G).
      Dropped tokens still count in N and |y_i| (AReaL's rule for capped tokens).
    - regularisers, aggregated the same way over all loss tokens (the behaviour weight and
      the drops do not apply: they are terms in θ alone): loss = agg(ℓ) − ``entropy_coef``
      · agg(H_t) + ``kl_coef`` · agg(k(logp_t, ref_t)), H_t the entropy of θ's next-token
      distribution, k the ``kl_estimator`` of ``algo.kl`` (k1|k2|k3) against the frozen
      reference model's logprobs. A coefficient of 0 adds nothing; the stats still sum
      H_t and k over the loss tokens when the tensors are given.

    Args:
        logprobs_T: log π_θ of each token (with grad).
        proximal_logprobs_T: log π_prox (recomputed, or ``loglinear_proximal_logprobs``).
        advantages_T: per-token advantages.
        loss_mask_T: tokens that count.
        num_global_tokens: loss tokens in the whole batch over all data-parallel ranks.
        eps_clip, eps_clip_high: ratio clipped to [1 - eps_clip, 1 + eps_clip_high].
        c_clip: dual-clip bound for negative advantages (> 1), or None.
        behave_logprobs_T: log π_behave for the decoupled loss; None: proximal is behave.
        behav_imp_weight_cap: the behaviour weight's cap (None: no cap).
        cu_seqlens_B1: sequence boundaries in the packed layout (padding included);
            needed by every sequence-level option.
        seq_group: under context parallelism, the CP group over which each sequence's
            tokens are spread (``PackedBatch.cp_group``): the per-sequence sums inside the
            terms (GSPO's mean log-ratio, the sequence weight, |y_i|) add up over it, while
            each rank aggregates its own tokens' terms, so the ranks' losses add up to the
            loss of the whole sequences.
        num_global_seqs: G above; needed by the ``seq-mean-*`` modes.
        loss_agg_mode, loss_norm_tokens, importance_sampling_level,
        behav_imp_weight_level, behav_imp_weight_mode: as above, named as the ``ppo.``
            config keys; the defaults are boba's loss.

    Returns:
        (loss, stats): the scalar loss and detached sums (see ``reduce_ppo_stats``).
    """
    _check_options(loss_agg_mode, importance_sampling_level, behav_imp_weight_level, behav_imp_weight_mode,
                   cu_seqlens_B1, num_global_seqs, loss_norm_tokens, behav_imp_weight_cap)
    if entropy_coef and entropy_T is None:
        raise ValueError("entropy_coef > 0 needs entropy_T")
    if kl_coef and ref_logprobs_T is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs_T")
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator={kl_estimator!r} is not allowed; choose one of {list(KL_ESTIMATORS)}")
    mask = loss_mask_T.bool()
    dtype = torch.promote_types(logprobs_T.dtype, torch.float32)  # fp32, or the tests' fp64
    adv = advantages_T.to(dtype)
    logp = logprobs_T.to(dtype)
    prox = proximal_logprobs_T.detach().to(dtype)
    per_seq = "sequence" in (importance_sampling_level, behav_imp_weight_level) or loss_agg_mode != "token-mean"
    seq = _Segments(cu_seqlens_B1, logp.numel(), seq_group) if per_seq else None  # boba's loss needs none
    bad = ~torch.isfinite(prox)
    over_cap = torch.zeros_like(mask)
    log_w = torch.zeros_like(prox)
    if behave_logprobs_T is not None:
        log_w = prox - behave_logprobs_T.detach().to(dtype)
        bad = bad | ~torch.isfinite(log_w)
        if behav_imp_weight_level == "sequence":  # one log-weight per sequence, over loss tokens
            bad_B = seq.sum((bad & mask).to(dtype)) > 0
            log_w = seq.spread(seq.sum(torch.where(mask & ~bad, log_w, 0.0)))
            bad = bad | seq.spread(bad_B)
        if behav_imp_weight_cap is not None:  # in log space: exp(log_w) may overflow
            over_cap = ~bad & (log_w > math.log(behav_imp_weight_cap))
    truncate = behav_imp_weight_mode == "truncate"
    capped = torch.zeros_like(mask) if truncate else over_cap
    kept = mask & ~bad & ~capped
    # Dropped tokens get θ's own logprob as proximal (ratio 1) and weight 0 *before* the
    # products, so no inf or NaN enters the graph at all.
    prox = torch.where(kept, prox, logp.detach())
    weight = torch.where(kept, torch.exp(torch.where(kept, log_w, 0.0)), 0.0)
    truncated = kept & over_cap if truncate else torch.zeros_like(mask)
    if truncate:
        weight = torch.where(truncated, float(behav_imp_weight_cap), weight)

    if importance_sampling_level == "token":
        ratio = torch.exp(logp - prox)
    else:  # GSPO: exp of the mean log-ratio over the sequence's kept tokens, for each of them
        n_kept_B = seq.sum(kept.to(dtype)).clamp(min=1.0)
        ratio = seq.spread(torch.exp(seq.sum(torch.where(kept, logp - prox, 0.0)) / n_kept_B))
    high = eps_clip if eps_clip_high is None else eps_clip_high
    loss1 = -adv * ratio
    loss2 = -adv * ratio.clamp(1.0 - eps_clip, 1.0 + high)
    pg = torch.maximum(loss1, loss2)
    clipped = loss2 > loss1
    dual = torch.zeros_like(mask)
    if c_clip is not None:  # for A < 0 the clipped loss is unbounded in the ratio: cap it
        loss3 = -adv * c_clip
        dual = (adv < 0) & (pg > loss3)
        pg = torch.where(dual, loss3, pg)
    agg = partial(_aggregate, mask=mask, seq=seq, loss_agg_mode=loss_agg_mode, num_global_tokens=num_global_tokens,
                  num_global_seqs=num_global_seqs, loss_norm_tokens=loss_norm_tokens)
    loss = agg(torch.where(kept, pg * weight, 0.0))
    entropy = None if entropy_T is None else torch.where(mask, entropy_T.to(dtype), 0.0)
    if entropy_coef:
        loss = loss - entropy_coef * agg(entropy)
    kl = None
    if ref_logprobs_T is not None:  # positions off the mask get log-ratio 0: k3's exp stays finite
        kl = torch.where(mask, kl_estimate(torch.where(mask, logp, 0.0),
                                           torch.where(mask, ref_logprobs_T.to(dtype), 0.0), kl_estimator), 0.0)
        if kl_coef:
            loss = loss + kl_coef * agg(kl)

    with torch.no_grad():
        k = kept.float()
        log_ratio = torch.where(kept, logp.detach() - prox, 0.0)
        stats = {
            "loss_tokens": mask.float().sum(),
            "kept_tokens": k.sum(),
            "dropped_tokens": (mask & ~kept).float().sum(),
            "cap_masked_tokens": (capped & mask).float().sum(),
            "nonfinite_tokens": (bad & mask).float().sum(),
            "clipped_tokens": (clipped & kept).float().sum(),
            "dual_clipped_tokens": (dual & kept).float().sum(),
            # k1 = log θ − log prox, AReaL's logged approx_kl (its mean is −KL(prox‖θ)
            # under samples from prox); k3 = (r − 1) − log r ≥ 0 estimates KL(prox‖θ).
            "approx_kl_sum": log_ratio.sum(),
            "approx_kl_k3_sum": (k * (torch.expm1(log_ratio) - log_ratio)).sum(),
            "behav_imp_weight_sum": weight.sum(),
            "behav_imp_weight_max": weight.amax() if weight.numel() else weight.sum(),
        }
        if truncate:
            stats["truncated_tokens"] = truncated.float().sum()
        if entropy is not None:
            stats["entropy_sum"] = entropy.detach().sum()
        if kl is not None:
            stats["ref_kl_sum"] = kl.detach().sum()
    return loss, stats


def _aggregate(token_T: torch.Tensor, *, mask, seq, loss_agg_mode, num_global_tokens, num_global_seqs,
               loss_norm_tokens) -> torch.Tensor:
    """``loss_agg_mode`` of per-token terms that are 0 off the loss tokens (docstring of
    ``ppo_actor_loss``); ``seq`` is the batch's ``_Segments`` (None for token-mean)."""
    if loss_agg_mode == "token-mean":
        return token_T.sum() / num_global_tokens
    per_seq_B = seq.local_sum(token_T)  # linear in the tokens: each CP rank sums its own
    if loss_agg_mode == "seq-mean-token-mean":  # |y_i| = 0 only where the sum is 0
        per_seq_B = per_seq_B / seq.sum(mask.to(token_T.dtype)).clamp(min=1.0)
    elif loss_agg_mode == "seq-mean-token-sum-norm":
        per_seq_B = per_seq_B / loss_norm_tokens
    return per_seq_B.sum() / num_global_seqs


class _Segments:
    """Per-sequence sums over a packed row and their spread back onto its tokens (B
    sequences of ``cu_seqlens_B1``, T tokens); no host sync. With ``group`` (context
    parallelism) the row holds this rank's share of each sequence: ``sum`` adds the
    shares over the group, differentiably (the backward all-reduces too: every rank's
    loss depends on every rank's tokens), ``local_sum`` is this rank's share alone."""

    def __init__(self, cu_seqlens_B1: torch.Tensor, T: int, group: dist.ProcessGroup | None = None):
        self.group = group
        cu = cu_seqlens_B1.to(torch.long)
        self.B = cu.numel() - 1
        tokens_T = torch.arange(T, device=cu.device)
        # sequence of each token (a token past the last boundary, if any, joins the last)
        self.seq_T = torch.searchsorted(cu[1:], tokens_T, right=True).clamp(max=self.B - 1)

    def local_sum(self, x_T: torch.Tensor) -> torch.Tensor:
        return x_T.new_zeros(self.B).index_add(0, self.seq_T, x_T)

    def sum(self, x_T: torch.Tensor) -> torch.Tensor:
        x_B = self.local_sum(x_T)
        return x_B if self.group is None else collectives.all_reduce_with_grad(x_B, self.group)

    def spread(self, x_B: torch.Tensor) -> torch.Tensor:
        return x_B[self.seq_T]


def _check_options(loss_agg_mode, importance_sampling_level, behav_imp_weight_level, behav_imp_weight_mode,
                   cu_seqlens_B1, num_global_seqs, loss_norm_tokens, behav_imp_weight_cap) -> None:
    """The options' values and what each needs (``PPOConfig`` refuses the same for users)."""
    for key, value, allowed in (("loss_agg_mode", loss_agg_mode, LOSS_AGG_MODES),
                                ("importance_sampling_level", importance_sampling_level, IS_LEVELS),
                                ("behav_imp_weight_level", behav_imp_weight_level, IS_LEVELS),
                                ("behav_imp_weight_mode", behav_imp_weight_mode, BEHAV_WEIGHT_MODES)):
        if value not in allowed:
            raise ValueError(f"{key}={value!r} is not allowed; choose one of {list(allowed)}")
    per_seq = ("sequence" in (importance_sampling_level, behav_imp_weight_level)
               or loss_agg_mode != "token-mean")
    if per_seq and cu_seqlens_B1 is None:
        raise ValueError("sequence-level options need cu_seqlens_B1 (the packed sequences' boundaries)")
    if loss_agg_mode != "token-mean" and num_global_seqs is None:
        raise ValueError(f"loss_agg_mode={loss_agg_mode!r} needs num_global_seqs")
    if loss_agg_mode == "seq-mean-token-sum-norm" and loss_norm_tokens is None:
        raise ValueError("loss_agg_mode='seq-mean-token-sum-norm' needs loss_norm_tokens")
    if behav_imp_weight_mode == "truncate" and behav_imp_weight_cap is None:
        raise ValueError("behav_imp_weight_mode='truncate' needs behav_imp_weight_cap")


def loglinear_proximal_logprobs(
    behave_logprobs_T: torch.Tensor,
    logprobs_T: torch.Tensor,
    versions_T: torch.Tensor,
    proximal_version: int,
) -> torch.Tensor:
    """Proximal logprobs without a forward pass (AReaL's "loglinear" approximation).

    log π_prox ≈ log π_behave + α (log π_θ − log π_behave), α = (v_prox − v_b) / (v_θ − v_b),
    clamped to [0, 1], v_b the version that generated each token; prompt tokens
    (version < 0) keep α = 0. The formula is AReaL's; the version labels are ours.

    Ours: ``proximal_version`` is the version the proximal weights carry in our loop (the
    PPO step's index: the weights synced to the servers as that version, which sampled its
    on-policy tokens) and v_θ = v_prox + 1 (θ becomes version step + 1 after this PPO
    step). AReaL (``compute_prox_logp_approximations``) passes the engine's current
    version as v_θ and takes v_prox = v_θ − 1, i.e. one version lower for the same
    weights: both give α = 0 for on-policy tokens (behave = prox exactly), but a token one
    version stale gets α = 1/2 here and α = 0 (no correction) in AReaL, and a token k
    versions stale gets k / (k + 1) here, (k − 1) / k there. We keep ours because its
    labels are the versions the rollout records: the proximal policy really is the one
    that sampled version-``step`` tokens, so they, and only they, must get α = 0.
    """
    v_b = versions_T.double()
    alpha = ((proximal_version - v_b) / (proximal_version + 1 - v_b)).clamp(0.0, 1.0)
    alpha = torch.where(versions_T >= 0, alpha, 0.0).to(logprobs_T.dtype)
    behave = behave_logprobs_T.to(logprobs_T.dtype)
    return (behave + alpha * (logprobs_T.detach() - behave)).detach()


STALENESS_BUCKETS = 5  # loglinear_gap_stats: staleness 0, 1, 2, 3 and 4 or more versions


def loglinear_gap_stats(proximal_logprobs_T: torch.Tensor, loglinear_T: torch.Tensor, loss_mask_T: torch.Tensor,
                        versions_T: torch.Tensor, proximal_version: int) -> dict[str, torch.Tensor]:
    """How far the log-linear proximal is from the recomputed one (``prox_logp_method:
    metrics``): sums of |Δ| over the loss tokens where both are finite, overall and by
    staleness (``proximal_version`` − the token's version, the last bucket "4 or more"),
    their token counts and the max; ``reduce_ppo_stats`` turns them into means."""
    with torch.no_grad():
        gap = (proximal_logprobs_T.float() - loglinear_T.float()).abs()
        ok = loss_mask_T.bool() & torch.isfinite(gap)
        gap = torch.where(ok, gap, 0.0)
        stale = (proximal_version - versions_T.long()).clamp(0, STALENESS_BUCKETS - 1)
        stats = {"loglinear_gap_sum": gap.sum(), "loglinear_gap_tokens": ok.float().sum(),
                 "loglinear_gap_max": gap.amax() if gap.numel() else gap.sum()}
        for k in range(STALENESS_BUCKETS):
            in_k = ok & (stale == k)
            stats[f"loglinear_gap_sum_stale{k}"] = torch.where(in_k, gap, 0.0).sum()
            stats[f"loglinear_gap_tokens_stale{k}"] = in_k.float().sum()
    return stats


_MAX_KEYS = ("behav_imp_weight_max", "loglinear_gap_max")
_OWN_KEYS = ("loss_tokens", "kept_tokens", "dropped_tokens", "cap_masked_tokens", "nonfinite_tokens",
             "clipped_tokens", "dual_clipped_tokens", "approx_kl_sum", "approx_kl_k3_sum",
             "behav_imp_weight_sum", "truncated_tokens", "entropy_sum", "ref_kl_sum", "loss",
             *_MAX_KEYS)  # "loss": the actor's, reported apart


def reduce_ppo_stats(
    stats: list[dict[str, torch.Tensor]], group: dist.ProcessGroup | None = None
) -> dict[str, float]:
    """Micro-batch stats → one step's ratios; all-reduced over ``group`` (None: local).

    Call once per step (it syncs with the host). ``behav_dropped_ratio`` (non-finite or
    over-cap, of which ``cap_masked_ratio`` over the cap and ``nonfinite_ratio`` not
    finite) is over the loss tokens, as is ``behav_truncated_ratio`` (weights cut to the
    cap, ``behav_imp_weight_mode="truncate"`` only), and so are the means ``entropy`` and
    ``ref_kl`` (when the loss got θ's entropy or the reference logprobs); the other ratios
    are over the kept tokens. Keys the
    caller added to the stats (e.g. ``empty_responses``) come back as totals.
    """
    keys = sorted(stats[0])
    max_keys = [k for k in _MAX_KEYS if k in keys]
    sums = torch.stack([sum(s[k] for s in stats) for k in keys if k not in _MAX_KEYS]).double()
    maxes = torch.stack([torch.stack([s[k] for s in stats]).max() for k in max_keys]).double()
    if group is not None:
        collectives.all_reduce(sums, group)
        collectives.all_reduce(maxes, group, op=dist.ReduceOp.MAX)
    total = dict(zip([k for k in keys if k not in _MAX_KEYS], sums.tolist()))
    total.update(zip(max_keys, maxes.tolist()))
    n = max(total["loss_tokens"], 1.0)
    kept = max(total["kept_tokens"], 1.0)
    extra = {k: v for k, v in total.items() if k not in _OWN_KEYS and not k.startswith("loglinear_gap")}
    truncated = {"behav_truncated_ratio": total["truncated_tokens"] / n} if "truncated_tokens" in total else {}
    # means over the loss tokens, when the loss was given the tensors
    regularisers = {name: total[key] / n for name, key in (("entropy", "entropy_sum"), ("ref_kl", "ref_kl_sum"))
                    if key in total}
    return {
        **extra,
        **truncated,
        **regularisers,
        **_loglinear_gap(total),
        "loss_tokens": total["loss_tokens"],
        "behav_dropped_ratio": total["dropped_tokens"] / n,
        "cap_masked_ratio": total["cap_masked_tokens"] / n,
        "nonfinite_ratio": total["nonfinite_tokens"] / n,
        "clip_ratio": total["clipped_tokens"] / kept,
        "dual_clip_ratio": total["dual_clipped_tokens"] / kept,
        "approx_kl": total["approx_kl_sum"] / kept,
        "approx_kl_k3": total["approx_kl_k3_sum"] / kept,
        "behav_imp_weight_mean": total["behav_imp_weight_sum"] / kept,
        "behav_imp_weight_max": total["behav_imp_weight_max"],
    }


def _loglinear_gap(total: dict[str, float]) -> dict[str, float]:
    """``loglinear_gap_stats``' sums → the mean |Δ| (overall and per staleness bucket,
    buckets without tokens left out) and the max; nothing when they were not computed."""
    if "loglinear_gap_sum" not in total:
        return {}
    out = {"loglinear_gap_mean": total["loglinear_gap_sum"] / max(total["loglinear_gap_tokens"], 1.0),
           "loglinear_gap_max": total["loglinear_gap_max"]}
    for k in range(STALENESS_BUCKETS):
        n = total[f"loglinear_gap_tokens_stale{k}"]
        if n > 0:
            label = f"{k}" if k < STALENESS_BUCKETS - 1 else f"{k}plus"
            out[f"loglinear_gap_mean_stale{label}"] = total[f"loglinear_gap_sum_stale{k}"] / n
    return out
