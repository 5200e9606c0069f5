"""The megatron-core actor: parallel state, model + optimizer, logprobs, train_batch."""

from areal_mcore.actor.megatron_actor import LossFn, MegatronActor

__all__ = ["LossFn", "MegatronActor"]
