"""The embedded rollout server (SGLang's HTTP API on a transformers model, for CPU runs and
fault injection) and its batched decode engine."""
