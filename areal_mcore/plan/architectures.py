"""The architecture the planner sizes: model_path's config.json, else a known model by name.

Planning happens before a run (often on a login node without the weights), so the boba
models' shapes (and the Qwen3 and Llama 3.1 recipes') are listed here, copied from their public HF ``config.json`` files.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from areal_mcore.model.args import ModelArgs, folder_args


def _qwen2(hidden, layers, heads, kv, ffn, vocab, tie):
    return dict(model_type="qwen2", hidden_size=hidden, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv, intermediate_size=ffn,
                vocab_size=vocab, tie_word_embeddings=tie, rms_norm_eps=1e-6,
                rope_theta=10000.0, max_position_embeddings=131072)


def _qwen3(hidden, layers, heads, kv, head_dim, ffn, vocab, tie):
    return dict(model_type="qwen3", hidden_size=hidden, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
                intermediate_size=ffn, vocab_size=vocab, tie_word_embeddings=tie, rms_norm_eps=1e-6,
                rope_theta=1000000.0, max_position_embeddings=40960)


def _qwen3_moe(hidden, layers, heads, kv, head_dim, ffn, vocab, tie, experts, top_k, moe_ffn, norm_topk):
    return dict(_qwen3(hidden, layers, heads, kv, head_dim, ffn, vocab, tie), model_type="qwen3_moe",
                num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=moe_ffn,
                norm_topk_prob=norm_topk, decoder_sparse_step=1, mlp_only_layers=[],
                router_aux_loss_coef=0.001)


def _llama3(hidden, layers, heads, kv, ffn, vocab, tie, rope_factor):
    return dict(model_type="llama", hidden_size=hidden, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv, intermediate_size=ffn,
                vocab_size=vocab, tie_word_embeddings=tie, rms_norm_eps=1e-5, rope_theta=500000.0,
                max_position_embeddings=131072,
                rope_scaling=dict(rope_type="llama3", factor=rope_factor, low_freq_factor=1.0,
                                  high_freq_factor=4.0, original_max_position_embeddings=8192))


KNOWN = {
    "DeepSeek-R1-Distill-Qwen-1.5B": _qwen2(1536, 28, 12, 2, 8960, 151936, False),
    "DeepSeek-R1-Distill-Qwen-7B": _qwen2(3584, 28, 28, 4, 18944, 152064, False),
    "DeepSeek-R1-Distill-Qwen-14B": _qwen2(5120, 48, 40, 8, 13824, 152064, False),
    "DeepSeek-R1-Distill-Qwen-32B": _qwen2(5120, 64, 40, 8, 27648, 152064, False),
    "Qwen3-8B": _qwen3(4096, 36, 32, 8, 128, 12288, 151936, False),
    "Llama-3.1-8B-Instruct": _llama3(4096, 32, 32, 8, 14336, 128256, False, 8.0),
    # intermediate_size 6144 is unused: every layer is routed (no mlp_only_layers).
    "Qwen3-30B-A3B": _qwen3_moe(2048, 48, 32, 4, 128, 6144, 151936, False, 128, 8, 768, True),
}


def resolve_architecture(model_path: str | None, name: str | None) -> tuple[ModelArgs, str]:
    """(args, where they came from). ``name`` (plan.architecture) wins over the path."""
    if name is None and model_path is not None:
        args = folder_args(model_path)
        if args is not None:
            return args, str(Path(model_path) / "config.json")
        name = Path(model_path).name if Path(model_path).name in KNOWN else None
    if name is None:
        raise ValueError(f"the planner needs the architecture: model_path={model_path!r} has no "
                         f"config.json; set plan.architecture to one of {sorted(KNOWN)}")
    if name not in KNOWN:
        raise ValueError(f"plan.architecture={name!r} is not known; choose one of {sorted(KNOWN)} "
                         f"or point model_path at an HF folder")
    return ModelArgs.from_hf(SimpleNamespace(**KNOWN[name])), f"plan/architectures.py:{name}"
