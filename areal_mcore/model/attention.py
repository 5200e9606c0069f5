"""Causal core attention for CPU that honours THD packing (the local spec's has no THD).

Shape legend: T = packed tokens, S = sequence length, B = batch, Hq/Hkv = query/kv heads
on this TP rank, D = head dim.

megatron's local ``DotProductAttention`` asserts on ``packed_seq_params``. This module
attends per segment of ``cu_seqlens`` (cost Σ Lᵢ², not T² as a block-diagonal mask over
the whole row would be), so packed sequences never see each other. GQA: query head h
reads kv group h // (Hq / Hkv), megatron's grouping.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig


class CPUCoreAttention(MegatronModule):
    """Drop-in ``core_attention`` for the local layer spec (same constructor and forward)."""

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type,
                 attention_type: str, attention_dropout: float | None = None,
                 softmax_scale: float | None = None, cp_comm_type: str | None = None,
                 pg_collection=None):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("CPUCoreAttention does not support context parallelism")
        head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params: PackedSeqParams | None = None):
        if attention_bias is not None:
            raise ValueError("CPUCoreAttention does not support attention_bias")
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            # query [T, Hq, D]; segments from the layout (padded) boundaries.
            cu = packed_seq_params.cu_seqlens_q_padded
            if cu is None:
                cu = packed_seq_params.cu_seqlens_q
            bounds = cu.tolist()
            out_THD = torch.empty_like(query)
            for s, e in zip(bounds[:-1], bounds[1:]):
                out_THD[s:e] = self._attend(query[s:e], key[s:e], value[s:e])
            return out_THD  # attention.py reshapes [T, Hq, D] -> [T, 1, Hq*D]
        # query [S, B, Hq, D]: each batch row is one sequence.
        S, B, Hq, D = query.shape
        out_SBHD = torch.stack([self._attend(query[:, b], key[:, b], value[:, b]) for b in range(B)], 1)
        return out_SBHD.reshape(S, B, Hq * D)

    def _attend(self, q_SHD, k_SHD, v_SHD):
        # [1, H, S, D] and enable_gqa, not [H, S, D] with K/V repeated per query head: torch
        # picks a fused kernel (flash, memory-efficient, cuDNN) only for 4-D inputs
        # (aten/src/ATen/native/transformers/sdp_utils_cpp.h, check_tensor_shapes), and the
        # math fallback upcasts bf16 to fp32 and keeps an [H, S, S] matrix per layer. SDPA's
        # GQA repeats K/V as repeat_interleave does: query head h reads kv head h // (Hq/Hkv).
        q_1HSD, k_1HSD, v_1HSD = (t.transpose(0, 1).unsqueeze(0) for t in (q_SHD, k_SHD, v_SHD))
        out_1HSD = F.scaled_dot_product_attention(
            q_1HSD, k_1HSD, v_1HSD, is_causal=True, scale=self.softmax_scale,
            dropout_p=self.dropout if self.training else 0.0,
            enable_gqa=q_1HSD.shape[1] != k_1HSD.shape[1],
        )
        return out_1HSD[0].transpose(0, 1)
