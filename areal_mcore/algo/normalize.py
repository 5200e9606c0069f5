"""Mean/std normalisation of rewards (per group of samples) and advantages (per batch).

Shape legend: B = sequences, T = packed tokens.

The definitions are AReaL's (``areal/utils/data.py::Normalization``), for every pair of
levels: with μ the mean at ``mean_level`` (0 for ``none``) and σ the root-mean-square
deviation *about that same μ*, taken over the entries of ``std_level``'s set,

    out = mask · (x − μ) / (σ + eps)          (σ = 1 and eps = 0 for std ``none``)

so mean=none/std=batch divides by the RMS of x, and mean=batch/std=group divides each
group by its spread about the batch mean (an all-equal group off the batch mean comes out
at ±1, not at ±1/eps). ``unbiased_std`` divides by n − 1; a set with n ≤ 1 (unbiased) or
n = 0 then has σ = 1, as in AReaL, so a single-sample group is never divided by eps.
Everything is computed in float64 (AReaL's ``high_precision``): in float32, x − μ of an
all-equal group is a rounding error of ~1e-7 that 1/eps would blow up to ~1e-2.

``group`` levels work on [B] per-sequence values (B a multiple of group_size, samples of
one prompt contiguous), optionally masked (masked-out samples do not count). ``batch``
levels also take [T] per-token values with a mask (token-weighted); given a process
group, their sums are all-reduced so every data-parallel rank normalises with the global
statistics. Group statistics never cross ranks: a group lives on one rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from areal_mcore import collectives

LEVELS = ("group", "batch", "none")


def normalize(
    values: torch.Tensor,
    *,
    mean_level: str,
    std_level: str,
    group_size: int | None = 1,
    unbiased_std: bool = False,
    eps: float = 1e-5,
    mask: torch.Tensor | None = None,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Normalises ``values``; masked-out entries come back as 0 (float32).

    The keyword arguments are the fields of ``config.NormConfig``, so a caller passes
    ``**dataclasses.asdict(cfg)``.

    Args:
        values: [B] per-sequence or [T] per-token values.
        mean_level, std_level: "group", "batch" or "none".
        group_size: samples per prompt for the group levels.
        unbiased_std: n - 1 instead of n in the variance.
        eps: added to the std before dividing (not used with std_level "none").
        mask: entries that count (e.g. loss_mask); None means all.
        group: data-parallel process group for batch levels; None means this rank only
            (not the default world group: process groups are always passed explicitly).

    Returns:
        The normalised values, float32, same shape.
    """
    for name, level in (("mean_level", mean_level), ("std_level", std_level)):
        if level not in LEVELS:
            raise ValueError(f"{name}={level!r} is not one of {list(LEVELS)}")
    x = values.double()
    m = torch.ones_like(x) if mask is None else mask.to(x.dtype)
    if "group" in (mean_level, std_level) and group_size is None:
        raise ValueError("group normalisation needs group_size (config: rollout.n_samples)")
    if "group" in (mean_level, std_level) and (x.dim() != 1 or x.numel() % group_size):
        raise ValueError(
            f"group normalisation needs one value per sequence with the batch a multiple of "
            f"group_size={group_size}; got shape {tuple(x.shape)}"
        )

    if mean_level == "none":
        mean = torch.zeros_like(x)
    else:
        total, count = _sums(m * x, m, mean_level, group_size, group)
        mean = _expand(total / count.clamp(min=1), mean_level, group_size, x)

    if std_level == "none":
        return (m * (x - mean)).float()
    sq_sum, count = _sums(m * (x - mean).square(), m, std_level, group_size, group)
    dof = count - 1 if unbiased_std else count
    std = torch.where(dof > 0, (sq_sum / dof.clamp(min=1)).sqrt(), 1.0)
    return (m * (x - mean) / (_expand(std, std_level, group_size, x) + eps)).float()


def _sums(xm: torch.Tensor, m: torch.Tensor, level: str, group_size: int,
          group: dist.ProcessGroup | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ m·x, Σ m) per group ([B / group_size] each) or over the batch (scalars,
    all-reduced over ``group``)."""
    if level == "group":
        return xm.view(-1, group_size).sum(1), m.view(-1, group_size).sum(1)
    sums = torch.stack([xm.sum(), m.sum()])
    if group is not None:
        collectives.all_reduce(sums, group)  # on the group's device and back (NCCL: GPU)
    return sums[0], sums[1]


def _expand(stat: torch.Tensor, level: str, group_size: int, like: torch.Tensor) -> torch.Tensor:
    return stat.repeat_interleave(group_size) if level == "group" else stat.expand_as(like)
