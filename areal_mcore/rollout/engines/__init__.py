"""Inference engines behind the rollout client (see ``base.py`` for the seam)."""

from __future__ import annotations

from areal_mcore.rollout.engines.base import Engine
from areal_mcore.rollout.engines.options import BACKENDS


def engine_for(backend: str) -> Engine:
    """The protocol of ``rollout.server.backend``."""
    if backend in ("sglang", "embedded"):
        from areal_mcore.rollout.engines.sglang import EmbeddedEngine, SGLangEngine

        return SGLangEngine() if backend == "sglang" else EmbeddedEngine()
    if backend == "vllm":
        from areal_mcore.rollout.engines.vllm import VLLMEngine

        return VLLMEngine()
    raise ValueError(f"rollout.server.backend must be one of {BACKENDS}, got {backend!r}")
