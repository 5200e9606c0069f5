"""The (decoupled) clipped PPO actor loss on packed per-token tensors, and its stats.

Shape legend: T = packed tokens. All tensors are aligned per token; ``loss_mask_T``
marks the tokens that count.

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
The loss is a sum divided by the global loss-token count, so micro-batch losses summed
over micro-batches and data-parallel ranks are exactly the token mean of the whole batch.
Logged ratios (clip, KL, behaviour weight) are over the kept tokens.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from areal_mcore import collectives


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
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped PPO loss of one micro-batch and its token-summed stats.

    Args:
        logprobs_T: log π_θ of each token (with grad).
        proximal_logprobs_T: log π_prox (recomputed, or ``loglinear_proximal_logprobs``).
        advantages_T: per-token advantages.
        loss_mask_T: tokens that count.
        num_global_tokens: loss tokens in the whole batch over all data-parallel ranks.
        eps_clip, eps_clip_high: ratio clipped to [1 - eps_clip, 1 + eps_clip_high].
        c_clip: dual-clip bound for negative advantages (> 1), or None.
        behave_logprobs_T: log π_behave for the decoupled loss; None: proximal is behave.
        behav_imp_weight_cap: drop tokens whose exp(prox - behave) exceeds this.

    Returns:
        (loss, stats): the scalar loss and detached sums (see ``reduce_ppo_stats``).
    """
    mask = loss_mask_T.bool()
    adv = advantages_T.float()
    logp = logprobs_T.float()
    prox = proximal_logprobs_T.detach().float()
    bad = ~torch.isfinite(prox)
    capped = torch.zeros_like(mask)
    log_w = torch.zeros_like(prox)
    if behave_logprobs_T is not None:
        log_w = prox - behave_logprobs_T.detach().float()
        bad = bad | ~torch.isfinite(log_w)
        if behav_imp_weight_cap is not None:  # in log space: exp(log_w) may overflow
            capped = ~bad & (log_w > math.log(behav_imp_weight_cap))
    kept = mask & ~bad & ~capped
    # Dropped tokens get θ's own logprob as proximal (ratio 1) and weight 0 *before* the
    # products, so no inf or NaN enters the graph at all.
    prox = torch.where(kept, prox, logp.detach())
    weight = torch.where(kept, torch.exp(torch.where(kept, log_w, 0.0)), 0.0)

    ratio = torch.exp(logp - prox)
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
    loss = torch.where(kept, pg * weight, 0.0).sum() / num_global_tokens

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
    return loss, stats


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


_MAX_KEYS = ("behav_imp_weight_max",)
_OWN_KEYS = ("loss_tokens", "kept_tokens", "dropped_tokens", "cap_masked_tokens", "nonfinite_tokens",
             "clipped_tokens", "dual_clipped_tokens", "approx_kl_sum", "approx_kl_k3_sum",
             "behav_imp_weight_sum", "loss", *_MAX_KEYS)  # "loss": the actor's, reported apart


def reduce_ppo_stats(
    stats: list[dict[str, torch.Tensor]], group: dist.ProcessGroup | None = None
) -> dict[str, float]:
    """Micro-batch stats → one step's ratios; all-reduced over ``group`` (None: local).

    Call once per step (it syncs with the host). ``behav_dropped_ratio`` (non-finite or
    over-cap, of which ``cap_masked_ratio`` over the cap and ``nonfinite_ratio`` not
    finite) is over the loss tokens; the other ratios are over the kept tokens. Keys the
    caller added to the stats (e.g. ``empty_responses``) come back as totals.
    """
    keys = sorted(stats[0])
    sums = torch.stack([sum(s[k] for s in stats) for k in keys if k not in _MAX_KEYS]).double()
    maxes = torch.stack([torch.stack([s[k] for s in stats]).max() for k in _MAX_KEYS]).double()
    if group is not None:
        collectives.all_reduce(sums, group)
        collectives.all_reduce(maxes, group, op=dist.ReduceOp.MAX)
    total = dict(zip([k for k in keys if k not in _MAX_KEYS], sums.tolist()))
    total.update(zip(_MAX_KEYS, maxes.tolist()))
    n = max(total["loss_tokens"], 1.0)
    kept = max(total["kept_tokens"], 1.0)
    extra = {k: v for k, v in total.items() if k not in _OWN_KEYS}  # the caller's counts
    return {
        **extra,
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
