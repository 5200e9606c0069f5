"""The (decoupled) clipped PPO actor loss on packed per-token tensors, and its stats.

Shape legend: T = packed tokens. All tensors are aligned per token; ``loss_mask_T``
marks the tokens that count.

Three policies (AReaL's decoupled PPO): behave (generated the tokens, maybe stale),
proximal (the weights at the start of this PPO step) and θ (being trained). The clipped
ratio is θ / proximal; the behaviour weight exp(prox − behave) corrects for staleness,
and tokens whose weight exceeds ``behav_imp_weight_cap`` are dropped (weight 0) but still
counted in the normaliser, as AReaL does. The loss is a sum divided by the global loss-
token count, so micro-batch losses summed over micro-batches and data-parallel ranks are
exactly the token mean of the whole batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


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
    prox = proximal_logprobs_T.detach().float()
    ratio = torch.exp(logprobs_T.float() - prox)
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

    weight = torch.ones_like(pg)
    capped = torch.zeros_like(mask)
    if behave_logprobs_T is not None:
        weight = torch.exp(prox - behave_logprobs_T.detach().float())
        if behav_imp_weight_cap is not None:
            capped = weight > behav_imp_weight_cap
    kept = mask & ~capped
    loss = torch.where(kept, pg * weight, 0.0).sum() / num_global_tokens

    with torch.no_grad():
        m = mask.float()
        log_ratio = logprobs_T.detach().float() - prox
        stats = {
            "loss_tokens": m.sum(),
            "clipped_tokens": (clipped & mask).float().sum(),
            "dual_clipped_tokens": (dual & mask).float().sum(),
            "cap_masked_tokens": (capped & mask).float().sum(),
            # k3 estimator of KL(prox || θ): non-negative, unbiased, low variance.
            "approx_kl_sum": (m * (torch.expm1(log_ratio) - log_ratio)).sum(),
            "behav_imp_weight_sum": (m * weight).sum(),
            "behav_imp_weight_max": (m * weight).amax() if m.numel() else m.sum(),
        }
    return loss, stats


def loglinear_proximal_logprobs(
    behave_logprobs_T: torch.Tensor,
    logprobs_T: torch.Tensor,
    versions_T: torch.Tensor,
    proximal_version: int,
) -> torch.Tensor:
    """Proximal logprobs without a forward pass (AReaL's "loglinear" approximation).

    log π_prox ≈ log π_behave + α (log π_θ − log π_behave), α = (v_prox − v_b) / (v_θ − v_b)
    with v_θ = v_prox + 1 (θ is one update past the proximal weights) and v_b the version
    that generated each token; prompt tokens (version < 0) keep α = 0.
    """
    v_b = versions_T.double()
    alpha = ((proximal_version - v_b) / (proximal_version + 1 - v_b)).clamp(0.0, 1.0)
    alpha = torch.where(versions_T >= 0, alpha, 0.0).to(logprobs_T.dtype)
    behave = behave_logprobs_T.to(logprobs_T.dtype)
    return (behave + alpha * (logprobs_T.detach() - behave)).detach()


_MAX_KEYS = ("behav_imp_weight_max",)


def reduce_ppo_stats(
    stats: list[dict[str, torch.Tensor]], group: dist.ProcessGroup | None = None
) -> dict[str, float]:
    """Micro-batch stats → one step's ratios; all-reduced over ``group`` (None: local).

    Call once per step (it syncs with the host). Ratios are over loss tokens.
    """
    keys = sorted(stats[0])
    sums = torch.stack([sum(s[k] for s in stats) for k in keys if k not in _MAX_KEYS]).double()
    maxes = torch.stack([torch.stack([s[k] for s in stats]).max() for k in _MAX_KEYS]).double()
    if group is not None:
        dist.all_reduce(sums, group=group)
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=group)
    total = dict(zip([k for k in keys if k not in _MAX_KEYS], sums.tolist()))
    total.update(zip(_MAX_KEYS, maxes.tolist()))
    n = max(total["loss_tokens"], 1.0)
    return {
        "loss_tokens": total["loss_tokens"],
        "clip_ratio": total["clipped_tokens"] / n,
        "dual_clip_ratio": total["dual_clipped_tokens"] / n,
        "cap_masked_ratio": total["cap_masked_tokens"] / n,
        "approx_kl": total["approx_kl_sum"] / n,
        "behav_imp_weight_mean": total["behav_imp_weight_sum"] / n,
        "behav_imp_weight_max": total["behav_imp_weight_max"],
    }
