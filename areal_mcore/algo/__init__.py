"""Pure tensor maths for boba PPO: reward shaping, normalisation, GAE, the actor loss."""

from areal_mcore.algo.gae import gae_packed
from areal_mcore.algo.kl import kl_estimate, kl_reward_penalty
from areal_mcore.algo.normalize import normalize
from areal_mcore.algo.ppo_loss import (
    loglinear_gap_stats,
    loglinear_proximal_logprobs,
    ppo_actor_loss,
    reduce_ppo_stats,
)
from areal_mcore.algo.reward_shaping import overlong_penalty, transform_reward

__all__ = [
    "gae_packed",
    "kl_estimate",
    "kl_reward_penalty",
    "loglinear_gap_stats",
    "loglinear_proximal_logprobs",
    "normalize",
    "overlong_penalty",
    "ppo_actor_loss",
    "reduce_ppo_stats",
    "transform_reward",
]
