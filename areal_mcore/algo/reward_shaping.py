"""Scalar reward shaping (boba: 1/0 correctness -> (r - 0.5) * 10 = ±5), and DAPO's
overlong penalty, added to the raw reward before that transform."""

from __future__ import annotations

import torch


def transform_reward(rewards_B: torch.Tensor, *, bias: float, scaling: float, clip: float) -> torch.Tensor:
    """``clamp((r + bias) * scaling, -clip, clip)``, per sequence."""
    return ((rewards_B.float() + bias) * scaling).clamp(-clip, clip)


def overlong_penalty(output_lens_B: torch.Tensor, *, max_new_tokens: int, buffer_len: int,
                     penalty_factor: float) -> torch.Tensor:
    """DAPO's soft overlong punishment (arXiv 2503.14476, eq. 13), per sequence: 0 for
    ``|y| <= max_new_tokens - buffer_len``, then ``(max_new_tokens - buffer_len - |y|) /
    buffer_len`` (linear down to -1 at ``max_new_tokens``; -1 beyond), times ``penalty_factor``.

    Args:
        output_lens_B: response lengths |y| (tokens).
        max_new_tokens: the generation limit L_max.
        buffer_len: L_cache, the tokens before L_max over which the penalty grows.
        penalty_factor: the penalty at L_max (DAPO: 1, in the raw reward's units).

    Returns:
        The penalties (<= 0, float32), to add to the raw rewards.
    """
    over_B = (output_lens_B.float() - (max_new_tokens - buffer_len)).clamp(min=0.0)
    return -penalty_factor * (over_B / buffer_len).clamp(max=1.0)
