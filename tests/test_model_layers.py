"""The model's own layers on the GPU path's terms: what they hand torch's kernels."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.transformer_config import TransformerConfig

from areal_mcore.model.attention import CPUCoreAttention
from areal_mcore.model.norm import SequenceParallelRMSNorm


def _config(dtype=torch.float32) -> TransformerConfig:
    return TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                             kv_channels=16, params_dtype=dtype, normalization="RMSNorm",
                             use_cpu_initialization=True)


def test_core_attention_gives_sdpa_4d_inputs_with_gqa_and_keeps_segments_apart(monkeypatch):
    """Fused SDPA kernels take 4-D inputs only (3-D fell back to the math kernel: bf16
    upcast to fp32, an [H, S, S] matrix per layer), and GQA without repeated K/V."""
    calls, real = [], F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        calls.append((q.shape, k.shape, kw.get("enable_gqa")))
        return real(q, k, v, **kw)
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(9, h, 16, generator=g) for h in (4, 2, 2))  # two segments: 5 + 4 tokens
    cu = torch.tensor([0, 5, 9], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=5, max_seqlen_kv=5)
    out = CPUCoreAttention(_config(), 1, None, "self").eval()(q, k, v, None, packed_seq_params=params)
    assert calls == [((1, 4, 5, 16), (1, 2, 5, 16), True), ((1, 4, 4, 16), (1, 2, 4, 16), True)]
    for s, e in ((0, 5), (5, 9)):  # reference: each segment alone, K/V repeated per query head
        want = real(q[s:e].transpose(0, 1), k[s:e].transpose(0, 1).repeat_interleave(2, 0),
                    v[s:e].transpose(0, 1).repeat_interleave(2, 0), is_causal=True, scale=0.25)
        torch.testing.assert_close(out[s:e], want.transpose(0, 1), rtol=1e-5, atol=1e-6)


def test_rms_norm_weights_take_the_models_dtype():
    """An fp32 norm weight beside bf16 activations keeps torch's RMSNorm off its fused
    kernel; megatron's other parameters (and TE's norms) are in params_dtype."""
    norm = SequenceParallelRMSNorm(_config(torch.bfloat16), 64, eps=1e-6)
    assert norm.weight.dtype == torch.bfloat16
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    assert norm(x).dtype == torch.bfloat16
