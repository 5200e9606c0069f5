"""The megatron-core actor: parallel state, model + optimizer, logprobs, train_batch.

``actor.config`` holds its config without megatron (the loader and the launcher read it);
``actor.megatron_actor`` the actor itself, ``actor.checkpoint`` its resumable checkpoints.
Import them by module: this package file stays empty so that reading the config never
starts the training stack.
"""
