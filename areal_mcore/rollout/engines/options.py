"""The engines ``server.backend`` names, and the server options that only one of them reads
(``server.<engine>.<key>``); the options every engine shares stay in ``ServerConfig``.

A module of its own that imports no adapter: ``rollout/config.py`` names these classes
in ``ServerConfig`` and every adapter names ``ServerConfig`` in its launch command, so an
options class inside its adapter module would close an import circle
(tests/test_layering.py). SGLang and the embedded server have no options of their own:
``mem_fraction_static`` and ``skip_tokenizer_init`` mean the same to SGLang and vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

from areal_mcore.checks import check_choice, check_positive

BACKENDS = ("sglang", "embedded", "vllm")  # one adapter each (__init__.py engine_for)
TRANSFER_BACKENDS = ("auto", "areal_gloo", "nccl")


@dataclass(kw_only=True)
class VLLMOptions:
    """``server.vllm``: read by ``engines/vllm.py``'s launch command only."""

    # vLLM's weight-transfer engine; auto: nccl with CUDA, else our areal_gloo plugin.
    weight_transfer_backend: str = "auto"
    # The KV cache size. None: server.mem_fraction_static on GPU; on CPU, where that is a
    # fraction of the host's memory, sized from the run (vllm.py cpu_kv_cache_bytes).
    kv_cache_memory_mb: float | None = None
    # Eager mode (no torch.compile: starts ~40 s sooner on CPU).
    enforce_eager: bool = False

    def __post_init__(self):
        check_choice("weight_transfer_backend", self.weight_transfer_backend, TRANSFER_BACKENDS)
        if self.kv_cache_memory_mb is not None:
            check_positive("kv_cache_memory_mb", self.kv_cache_memory_mb)
