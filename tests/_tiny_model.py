"""A tiny random Qwen2 built with transformers (no downloads), for actor tests."""

from __future__ import annotations

import torch


def tiny_qwen2(seed: int = 0, *, tie: bool = False, layers: int = 4, vocab: int = 250):
    """(hf_config, state_dict, model) of a seeded random Qwen2 in fp32, eval mode."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
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
