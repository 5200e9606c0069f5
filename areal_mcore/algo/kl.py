"""Per-token estimators of KL(π‖π_ref) from samples of π (Schulman, "Approximating KL
divergence", 2020, http://joschu.net/blog/kl-approx.html).

Shape legend: T = packed tokens.

With log-ratio x = log π_ref(y_t) − log π(y_t) and y_t ~ π:
    k1 = −x                      unbiased, high variance, can be negative;
    k2 = x² / 2                  biased, low variance, ≥ 0;
    k3 = (eˣ − 1) − x            unbiased, low variance, ≥ 0 (GRPO, arXiv 2402.03300,
                                 puts it in the loss).
Their gradients in π differ: the loss term (``ppo.kl_in: loss``) differentiates the chosen
estimator as written, as GRPO and verl do.
"""

from __future__ import annotations

import torch

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(logprobs_T: torch.Tensor, ref_logprobs_T: torch.Tensor, estimator: str) -> torch.Tensor:
    """The ``estimator`` (k1|k2|k3) of each token; differentiable through ``logprobs_T``.

    Callers mask it: take care that the log-ratio of positions they drop is finite (0),
    since k3's exp of a huge ratio would put inf · 0 = NaN into a backward pass.
    """
    x_T = ref_logprobs_T.detach().to(logprobs_T.dtype) - logprobs_T
    if estimator == "k1":
        return -x_T
    if estimator == "k2":
        return 0.5 * x_T.square()
    if estimator == "k3":
        return torch.expm1(x_T) - x_T
    raise ValueError(f"kl_estimator={estimator!r} is not allowed; choose one of {list(KL_ESTIMATORS)}")


def kl_reward_penalty(proximal_logprobs_T: torch.Tensor, ref_logprobs_T: torch.Tensor, loss_mask_T: torch.Tensor,
                      estimator: str) -> torch.Tensor:
    """k(prox, ref) on the loss tokens, 0 elsewhere and where it is not finite; detached
    (``ppo.kl_in: reward`` subtracts ``kl_coef`` times it from each token's reward)."""
    mask = loss_mask_T.bool()
    prox = torch.where(mask, proximal_logprobs_T.detach().double(), 0.0)
    k_T = kl_estimate(prox, torch.where(mask, ref_logprobs_T.double(), 0.0), estimator)
    return torch.where(mask & torch.isfinite(k_T), k_T, 0.0).float()
