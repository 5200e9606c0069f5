"""A tiny random Qwen2 built with transformers (no downloads), for actor tests."""

from __future__ import annotations

import torch


def tiny_qwen2(seed: int = 0, *, tie: bool = False, layers: int = 4, vocab: int = 250,
               hidden: int = 64, heads: int = 4, kv_heads: int = 2, intermediate: int = 96,
               positions: int = 256):
    """(hf_config, state_dict, model) of a seeded random Qwen2 in fp32, eval mode.

    The default head_dim is 16; vLLM's CPU attention needs 32 or more (``VLLM_SHAPE``)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=positions,
        rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=tie, use_sliding_window=False,
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).float().eval()
    with torch.no_grad():  # HF zero-inits biases; random ones test the qkv bias mapping
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return config, state, model


# head_dim 32: served by vLLM's CPU attention (head_dim 16 is refused)
VLLM_SHAPE = {"hidden": 128, "heads": 4, "kv_heads": 2, "intermediate": 192}
