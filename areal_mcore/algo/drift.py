"""Train-vs-rollout drift: the rollout engine's logprobs of the tokens it sampled against
the trainer's proximal logprobs of the same tokens.

Legend: T = packed tokens; S = staleness buckets; H = histogram bins.

With the same weights on both sides the two differ only by numerics (kernels, dtype,
batch shapes), a few 1e-3 in bf16; an engine that serves other weights than the trainer
pushed (a bad load, a wrong cast or shard, an engine bug) shows as a gap that the PPO
ratio's clipping hides. Per step: mean and p99 |Δ| (Δ = prox − behave) and the k3
estimate of KL(behave ‖ prox) = E_behave[(r − 1) − log r], r = exp(Δ), over the loss
tokens whose two logprobs are finite (a behaviour weight over ``behav_imp_weight_cap``
still counts: a cap would hide the drift this is meant to catch), split by staleness
(proximal version − the version that sampled the token): staleness 0 is the engine's
drift alone; older tokens add the policy's own change since.
The p99 comes from a log-spaced histogram all-reduced over the data-parallel group (one
sum, exact to its bin width, 1/``BINS_PER_DECADE`` of a decade).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from areal_mcore import collectives

BINS_PER_DECADE = 20
LOG10_LOW, LOG10_HIGH = -9, 3  # |Δ| below 1e-9 (0 included) lands in bin 0, above 1e3 in the last
N_STALE = 8  # staleness 0..6 apart, 7 and older together


def _edges(device) -> torch.Tensor:
    n = (LOG10_HIGH - LOG10_LOW) * BINS_PER_DECADE + 1
    return torch.logspace(LOG10_LOW, LOG10_HIGH, n, dtype=torch.float64, device=device)


def rollout_gap_sums(behave_T: torch.Tensor, prox_T: torch.Tensor, loss_mask_T: torch.Tensor,
                     versions_T: torch.Tensor, proximal_version: int) -> torch.Tensor:
    """This rank's sums (one float64 vector, for ``reduce_rollout_gap``).

    Args:
        behave_T: the rollout engine's logprobs (0 on prompt tokens).
        prox_T: the trainer's proximal logprobs of the same tokens.
        loss_mask_T: the response tokens.
        versions_T: the weight version that sampled each token (-1 on the prompt).
        proximal_version: the version of the proximal weights (this step's index).
    """
    prox, behave = prox_T.detach().double(), behave_T.detach().double()
    kept = loss_mask_T.bool() & torch.isfinite(prox) & torch.isfinite(behave)
    delta = torch.where(kept, prox - behave, 0.0)
    k = kept.double()
    stale_T = (proximal_version - versions_T.long()).clamp(0, N_STALE - 1)
    per_stale = torch.zeros(3, N_STALE, dtype=torch.float64, device=prox.device)
    for row, value in enumerate((k, delta.abs(), torch.expm1(delta) - delta)):
        per_stale[row].index_add_(0, stale_T, value * k)
    edges = _edges(prox.device)
    hist_H = torch.zeros(edges.numel() + 1, dtype=torch.float64, device=prox.device)
    hist_H.index_add_(0, torch.bucketize(delta.abs(), edges), k)
    return torch.cat([per_stale.flatten(), hist_H])


def reduce_rollout_gap(sums: torch.Tensor, group: dist.ProcessGroup | None = None) -> dict[str, float]:
    """The step's stats from every rank's ``rollout_gap_sums`` (all-reduced over ``group``,
    the data-parallel one; None: local). One host sync.

    Returns ``tokens``, ``gap_mean_abs``, ``gap_p99_abs`` (the upper edge of the histogram
    bin holding the 99th percentile), ``k3_kl``, and the same per staleness ``s``
    (``tokens_stale{s}``, ``gap_mean_abs_stale{s}``, ``k3_kl_stale{s}``) where it has tokens.
    """
    sums = sums.clone()
    if group is not None:
        collectives.all_reduce(sums, group)
    sums = sums.cpu()  # the one host sync; the rest is a few hundred numbers
    per_stale, hist_H = sums[: 3 * N_STALE].view(3, N_STALE), sums[3 * N_STALE:]
    n = float(per_stale[0].sum())
    cdf = torch.cumsum(hist_H, 0)
    upper = torch.cat([_edges(sums.device), torch.tensor([float("inf")], dtype=torch.float64, device=sums.device)])
    p99 = float(upper[int(torch.searchsorted(cdf, 0.99 * n))]) if n else 0.0
    out = {"tokens": n, "gap_mean_abs": float(per_stale[1].sum()) / max(n, 1.0), "gap_p99_abs": p99,
           "k3_kl": float(per_stale[2].sum()) / max(n, 1.0)}
    for s, (count, gap, k3) in enumerate(per_stale.T.tolist()):
        if count:
            out.update({f"tokens_stale{s}": count, f"gap_mean_abs_stale{s}": gap / count, f"k3_kl_stale{s}": k3 / count})
    return out
