"""Causal core attention for CPU that honours THD packing (the local spec's has no THD).

Shape legend: T = packed tokens, S = sequence length, B = batch, Hq/Hkv = query/kv heads
on this TP rank, D = head dim.

megatron's local ``DotProductAttention`` asserts on ``packed_seq_params``. This module
attends per segment of ``cu_seqlens`` (cost Σ Lᵢ², not T² as a block-diagonal mask over
the whole row would be), so packed sequences never see each other. GQA: query head h
reads kv group h // (Hq / Hkv), megatron's grouping.

Context parallelism (``context_parallel_size`` > 1, which megatron's local attention
refuses): each CP rank holds two chunks of every sequence (``packing.cp``), while the
``cu_seqlens`` are the whole row's. K and V are all-gathered over the CP group, as TE's
``cp_comm_type="all_gather"`` does, and each local query chunk attends to the keys up to
its own last position. The gather's backward reduce-scatters the K/V gradients, so every
rank gets the gradient of its own tokens from all ranks' queries. On CPU there is one way
(``cp_comm_type`` is TE's choice and is ignored here).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from areal_mcore.packing.cp import cp_gather_order


class CPUCoreAttention(MegatronModule):
    """Drop-in ``core_attention`` for the local layer spec (same constructor and forward)."""

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type,
                 attention_type: str, attention_dropout: float | None = None,
                 softmax_scale: float | None = None, cp_comm_type: str | None = None,
                 pg_collection=None):
        super().__init__(config=config)
        # The CP group as megatron's TEDotProductAttention takes it: from pg_collection, else
        # from parallel_state (extensions/transformer_engine.py, __init__; the local
        # DotProductAttention asserts context_parallel_size == 1 instead).
        cp = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        self.cp_group = cp if cp is not None else parallel_state.get_context_parallel_group(check_initialized=False)
        self.cp_size = config.context_parallel_size
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
            if self.cp_size > 1:
                return self._forward_cp(query, key, value, bounds)
            out_THD = torch.empty_like(query)
            for s, e in zip(bounds[:-1], bounds[1:]):
                out_THD[s:e] = self._attend(query[s:e], key[s:e], value[s:e])
            return out_THD  # attention.py reshapes [T, Hq, D] -> [T, 1, Hq*D]
        if self.cp_size > 1:
            raise ValueError("CPUCoreAttention splits sequences over CP ranks only in THD packing")
        # query [S, B, Hq, D]: each batch row is one sequence.
        S, B, Hq, D = query.shape
        out_SBHD = torch.stack([self._attend(query[:, b], key[:, b], value[:, b]) for b in range(B)], 1)
        return out_SBHD.reshape(S, B, Hq * D)

    def _forward_cp(self, q_tHD, k_tHD, v_tHD, bounds: list[int]):
        """Attention of this CP rank's queries [t, Hq, D] over the whole sequences' keys."""
        lens = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
        cp, r = self.cp_size, self.cp_group.rank()
        # The gathered rows are the ranks' tokens in rank order; ``inv`` puts them back in
        # the packed row's order (built once per micro-batch, not per layer: packing/cp.py).
        _, inv = cp_gather_order(lens, cp, k_tHD.device)
        k_THD, v_THD = (gather_from_sequence_parallel_region(t, True, self.cp_group).index_select(0, inv)
                        for t in (k_tHD, v_tHD))
        out_tHD, local = torch.empty_like(q_tHD), 0
        for start, n in zip(bounds[:-1], lens):
            c = n // (2 * cp)
            for chunk in (r, 2 * cp - 1 - r):
                end = start + (chunk + 1) * c  # the chunk's queries see keys [start, end)
                out_tHD[local:local + c] = self._attend(q_tHD[local:local + c], k_THD[start:end],
                                                        v_THD[start:end])
                local += c
        return out_tHD

    def _attend(self, q_SHD, k_SHD, v_SHD):
        # [1, H, S, D] and enable_gqa, not [H, S, D] with K/V repeated per query head: torch
        # picks a fused kernel (flash, memory-efficient, cuDNN) only for 4-D inputs
        # (aten/src/ATen/native/transformers/sdp_utils_cpp.h, check_tensor_shapes), and the
        # math fallback upcasts bf16 to fp32 and keeps an [H, S, S] matrix per layer. SDPA's
        # GQA repeats K/V as repeat_interleave does: query head h reads kv head h // (Hq/Hkv).
        q_1HSD, k_1HSD, v_1HSD = (t.transpose(0, 1).unsqueeze(0) for t in (q_SHD, k_SHD, v_SHD))
        if q_SHD.shape[0] == k_SHD.shape[0]:
            return self._sdpa(q_1HSD, k_1HSD, v_1HSD)[0].transpose(0, 1)
        # Fewer queries than keys (a CP chunk past a sequence's first): its causal mask, which
        # SDPA materialises as [queries, keys] and saves for the backward in every layer,
        # would hold more than the rest of the layer at long sequences (cp=2 saved 1.4x what
        # cp=1 does at 4k tokens; bench/cp_memory.py). So this attention is recomputed in the
        # backward: only q, k and v are kept (k and v are views of the gathered K/V). Under
        # megatron's recompute (full, or selective core_attn) the layer keeps nothing of it
        # already, and a second checkpoint would only run it a third time.
        if self.config.recompute_granularity is not None:
            return self._sdpa(q_1HSD, k_1HSD, v_1HSD)[0].transpose(0, 1)
        out_1HSD = torch.utils.checkpoint.checkpoint(self._sdpa, q_1HSD, k_1HSD, v_1HSD, use_reentrant=False)
        return out_1HSD[0].transpose(0, 1)

    def _sdpa(self, q_1HSD, k_1HSD, v_1HSD):
        # The queries are the keys' last positions, so a causal mask of fewer queries than
        # keys is aligned to the bottom right; SDPA's is_causal aligns it to the top left
        # (torch/nn/functional.py, scaled_dot_product_attention).
        sq, sk = q_1HSD.shape[2], k_1HSD.shape[2]
        mask = None
        if sq != sk:
            # Imported here: torch/nn/attention/bias.py imports dynamo (~5 s of a 2-core
            # machine), which a process that never attends across CP chunks need not pay.
            from torch.nn.attention.bias import causal_lower_right

            mask = causal_lower_right(sq, sk)
        return F.scaled_dot_product_attention(
            q_1HSD, k_1HSD, v_1HSD, is_causal=mask is None, attn_mask=mask, scale=self.softmax_scale,
            dropout_p=self.dropout if self.training else 0.0,
            enable_gqa=q_1HSD.shape[1] != k_1HSD.shape[1],
        )
