"""Scalar reward shaping (boba: 1/0 correctness -> (r - 0.5) * 10 = ±5)."""

from __future__ import annotations

import torch


def transform_reward(rewards_B: torch.Tensor, *, bias: float, scaling: float, clip: float) -> torch.Tensor:
    """``clamp((r + bias) * scaling, -clip, clip)``, per sequence."""
    return ((rewards_B.float() + bias) * scaling).clamp(-clip, clip)
