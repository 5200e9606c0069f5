"""Mean/std normalisation of rewards (per group of samples) and advantages (per batch).

Shape legend: B = sequences, T = packed tokens.

``group`` levels need one value per sequence ([B], B a multiple of group_size, samples of
one prompt contiguous). ``batch`` levels work on per-sequence or per-token values; with a
mask only masked-in entries count (token-weighted) and, given a process group, the sums
are all-reduced so every data-parallel rank normalises with the global statistics.
The std is that of the values after the mean step, so the result has unit spread at the
std level: with mean=group and std=batch, the batch std of group-centred values.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

LEVELS = ("group", "batch", "none")


def normalize(
    values: torch.Tensor,
    *,
    mean_level: str,
    std_level: str,
    group_size: int = 1,
    unbiased_std: bool = False,
    eps: float = 1e-5,
    mask: torch.Tensor | None = None,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Normalises ``values``; masked-out entries come back as 0.

    The keyword arguments are the fields of ``config.NormConfig``, so a caller passes
    ``**dataclasses.asdict(cfg)``.

    Args:
        values: [B] per-sequence or [T] per-token values.
        mean_level, std_level: "group", "batch" or "none".
        group_size: samples per prompt for the group levels.
        unbiased_std: n - 1 instead of n in the variance.
        eps: added to the std before dividing.
        mask: entries that count (e.g. loss_mask); None means all.
        group: data-parallel process group for batch levels; None means this rank only
            (not the default world group: process groups are always passed explicitly).
    """
    for name, level in (("mean_level", mean_level), ("std_level", std_level)):
        if level not in LEVELS:
            raise ValueError(f"{name}={level!r} is not one of {list(LEVELS)}")
    x = values.float()
    m = torch.ones_like(x) if mask is None else mask.to(x.dtype)
    uses_group = "group" in (mean_level, std_level)
    if uses_group and (mask is not None or x.numel() % group_size):
        raise ValueError(
            f"group normalisation needs one unmasked value per sequence with the batch a "
            f"multiple of group_size={group_size}; got {x.numel()} values"
            + (" and a mask" if mask is not None else "")
        )
    if mean_level == "group":
        x = x - x.view(-1, group_size).mean(1).repeat_interleave(group_size)
    elif mean_level == "batch":
        x = x - _batch_mean(x, m, group)
    if std_level == "group":
        g = x.view(-1, group_size)
        std = g.std(1, unbiased=unbiased_std) if group_size > 1 else torch.zeros(len(g))
        x = x / (std + eps).repeat_interleave(group_size)
    elif std_level == "batch":
        sq_sum, count = _masked_sums((x - _batch_mean(x, m, group)).square(), m, group)
        dof = count - 1 if unbiased_std else count
        x = x / ((sq_sum / dof.clamp(min=1)).sqrt() + eps).to(x.dtype)
    return x * m


def _masked_sums(x: torch.Tensor, m: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ m·x, Σ m) in float64, summed over the ranks of ``group`` (None: this rank)."""
    sums = torch.stack([(m * x).sum(), m.sum()]).double()
    if group is not None:
        dist.all_reduce(sums, group=group)
    return sums[0], sums[1]


def _batch_mean(x: torch.Tensor, m: torch.Tensor, group) -> torch.Tensor:
    total, count = _masked_sums(x, m, group)
    return (total / count.clamp(min=1)).to(x.dtype)
