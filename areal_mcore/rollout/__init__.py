"""Rollout: SGLang HTTP client, an embedded CPU server with the same API, a server
launcher, and the executor that turns prompts into batches through an episode. Never
imports megatron or the actor."""
