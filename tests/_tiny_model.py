"""Tiny random HF causal LMs built with transformers (no downloads), for the model tests.

``tiny_model(arch)`` builds each architecture the model layer supports: ``qwen2`` (the
boba models; ``tiny_qwen2`` is it), ``qwen3`` (per-head q/k norms, a ``head_dim`` other
than hidden/heads), ``llama3`` (LLaMA with Llama 3.1's RoPE scaling), ``qwen3_moe``
(8 experts, top-2, renormalised; layer 2 of 4 dense via ``mlp_only_layers``) and
``qwen2_moe`` (the same experts, not renormalised as in Qwen1.5-MoE, plus a gated shared expert).
"""

from __future__ import annotations

import torch

# Llama 3.1's rope_scaling, at a rope_theta under which it moves some frequencies of a
# head_dim-16 model within 100 positions (Llama 3's own theta, 500000).
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
ARCHS = ("qwen2", "qwen3", "llama3", "qwen3_moe", "qwen2_moe")
# The MoE model's experts: its dense layer (mlp_only_layers) is the first layer of the second
# pipeline stage at pp=2, so a stage's local layer indices must find the right global ones.
MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True,
       "mlp_only_layers": [2], "decoder_sparse_step": 1}
QWEN2_MOE = {**MOE, "norm_topk_prob": False, "shared_expert_intermediate_size": 48}


def _config(arch: str, rope_parameters: dict | None, moe: dict | None = None, head_dim: int | None = None,
            **common):
    from transformers import LlamaConfig, Qwen2Config, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig

    if arch == "qwen2":
        return Qwen2Config(**common, rope_theta=10000.0, use_sliding_window=False)
    if arch == "qwen3":  # head_dim 24 != hidden 64 / 4 heads: megatron's kv_channels
        return Qwen3Config(**common, head_dim=head_dim or 24, rope_theta=10000.0, use_sliding_window=False)
    if arch == "qwen3_moe":  # head_dim 32 != hidden 64 / 4 heads
        return Qwen3MoeConfig(**common, **{**MOE, **(moe or {})}, head_dim=head_dim or 32, rope_theta=10000.0,
                              use_sliding_window=False)
    if arch == "qwen2_moe":  # head_dim: hidden / heads, as Qwen2MoeConfig has no head_dim
        return Qwen2MoeConfig(**common, **{**QWEN2_MOE, **(moe or {})}, rope_theta=10000.0, use_sliding_window=False)
    if arch == "llama3":  # Llama 3.1's max_position_embeddings (transformers warns below 8192)
        return LlamaConfig(**{**common, "max_position_embeddings": 131072},
                           rope_parameters=dict(rope_parameters or LLAMA3_ROPE))
    raise ValueError(f"arch={arch!r}: one of {list(ARCHS)}")


def tiny_model(arch: str = "qwen2", seed: int = 0, *, tie: bool = False, layers: int = 4, vocab: int = 250,
               hidden: int = 64, heads: int = 4, kv_heads: int = 2, intermediate: int = 96,
               positions: int = 256, rope_parameters: dict | None = None, qk_gain: float = 1.0,
               moe: dict | None = None, head_dim: int | None = None):
    """(hf_config, state_dict, model) of a seeded random model of ``arch`` in fp32, eval mode.

    ``rope_parameters`` overrides llama3's RoPE settings, ``moe`` keys of qwen3_moe's ``MOE``
    (qwen2_moe's ``QWEN2_MOE``).
    ``qk_gain`` scales the q/k projections: at HF's init (std 0.02) attention is near uniform and hardly sees positions,
    so a wrong RoPE would change logprobs by only ~1e-4; a gain of 8 makes it ~1e-2.
    The default head_dim is 16 (24 for qwen3, 32 for qwen3_moe, or ``head_dim``); vLLM's CPU
    attention needs 32 or more (``VLLM_SHAPE``). The state dict has the names of HF checkpoint
    files (what ``save_pretrained`` writes): transformers >= 5 keeps MoE experts stacked in
    memory (``mlp.experts.gate_up_proj``) and unstacks them on save (``revert_weight_conversion``)."""
    from transformers import AutoModelForCausalLM

    config = _config(arch, rope_parameters, moe, head_dim, vocab_size=vocab, hidden_size=hidden,
                     intermediate_size=intermediate, num_hidden_layers=layers, num_attention_heads=heads,
                     num_key_value_heads=kv_heads, max_position_embeddings=positions, rms_norm_eps=1e-6,
                     tie_word_embeddings=tie, attn_implementation="eager")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():  # HF inits biases to 0 and norms to 1; random ones test their mapping
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if qk_gain != 1.0 and name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(qk_gain)
            if name.endswith("mlp.gate.weight"):
                # Router logits of std ~2, not HF's ~0.1: the top-k is then decided by margins
                # far above float rounding, so megatron and HF pick the same experts.
                p.normal_(0.0, 0.3)
    from transformers.core_model_loading import revert_weight_conversion

    state = {k: v.detach().clone() for k, v in revert_weight_conversion(model, model.state_dict()).items()}
    return config, state, model


def tiny_qwen2(seed: int = 0, **shape):
    """``tiny_model("qwen2", ...)``: the tiny model of the actor, rollout and PPO tests."""
    return tiny_model("qwen2", seed, **shape)


# head_dim 32: served by vLLM's CPU attention (16 and 24 are refused: "Unsupported CPU
# attention configuration")
VLLM_SHAPE = {"hidden": 128, "heads": 4, "kv_heads": 2, "intermediate": 192, "head_dim": 32}


EVAL_LENGTHS = [100, 7, 37]  # packed into one micro-batch; 100 tokens let llama3's RoPE scaling show


def eval_seqs(vocab: int) -> list[torch.Tensor]:
    """The seeded sequences the model tests score, packed and alone."""
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, vocab, (n,), generator=g) for n in EVAL_LENGTHS]


def hf_seq_logprobs(model, seqs: list[torch.Tensor]) -> torch.Tensor:
    """transformers' per-token logprobs of each sequence alone (0 at its first token), concatenated."""
    out = []
    with torch.no_grad():
        for s in seqs:
            lp = torch.zeros(len(s))
            lp[1:] = model(s[None]).logits[0, :-1].log_softmax(-1).gather(1, s[1:, None]).squeeze(1)
            out.append(lp)
    return torch.cat(out)


def task_assets(tmp_path, arch: str, **model_kw) -> dict[str, str]:
    """The tiny boba task (``data/tiny_assets.py``: train/test sets, tokenizer and chat
    template) with a random ``tiny_model(arch, **model_kw)`` under its tokenizer, for PPO
    runs of an architecture: ``assets["model"]`` is the model folder."""
    import json
    import shutil
    from pathlib import Path

    from areal_mcore.data.tiny_assets import TinyAssetsConfig, build_tiny_assets

    assets = build_tiny_assets(TinyAssetsConfig(out_dir=str(tmp_path / "assets"), n_train=16, n_test=4,
                                                hidden_size=32, intermediate_size=64, num_layers=1))
    tok_dir, model_dir = Path(assets["model"]), tmp_path / arch
    vocab = json.loads((tok_dir / "config.json").read_text())
    _, _, model = tiny_model(arch, seed=1, vocab=vocab["vocab_size"], **model_kw)
    model.config.eos_token_id = model.generation_config.eos_token_id = vocab["eos_token_id"]
    model.config.pad_token_id = vocab["pad_token_id"]
    model.save_pretrained(model_dir)
    for f in tok_dir.iterdir():  # the tokenizer's files and chat template
        if f.suffix != ".safetensors" and f.name not in ("config.json", "generation_config.json"):
            shutil.copy(f, model_dir)
    return {**assets, "model": str(model_dir)}
