"""Rollout: SGLang HTTP client, an embedded CPU server with the same API, a server
launcher and the async rollout controller. Never imports megatron or the actor."""
