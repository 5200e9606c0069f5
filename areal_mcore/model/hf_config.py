"""``ModelArgs`` -> megatron ``TransformerConfig``, layer spec and ``GPTModel``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from areal_mcore.model.args import ModelArgs
from areal_mcore.model.attention import CPUCoreAttention


def transformer_config(args: ModelArgs, *, tp_size: int, pp_size: int, params_dtype: torch.dtype,
                       recompute: bool = False, on_gpu: bool = False, fused: bool = False) -> TransformerConfig:
    """The megatron config for ``args`` under the given parallelism.

    ``recompute`` turns on full-layer activation recomputation (long contexts trade a
    second forward for memory). ``fused`` turns on megatron's fused kernels, which need
    TransformerEngine/apex on a GPU.
    """
    if args.num_layers % pp_size:
        raise ValueError(f"num_hidden_layers={args.num_layers} must be divisible by pp={pp_size}")
    for name, value in (("num_attention_heads", args.num_heads), ("num_key_value_heads", args.num_kv_heads)):
        if value % tp_size:
            raise ValueError(f"{name}={value} must be divisible by tp={tp_size}")
    recompute_kw = (
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        if recompute else {}
    )
    return TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_heads,
        num_query_groups=args.num_kv_heads,
        kv_channels=args.head_dim,
        ffn_hidden_size=args.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=args.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=args.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp_size,
        pipeline_model_parallel_size=pp_size,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        # THD micro-batches differ in length: PP must exchange shapes before tensors.
        variable_seq_lengths=True,
        # megatron's validation asks for this with variable_seq_lengths even without MoE.
        moe_token_dispatcher_type="alltoall",
        use_cpu_initialization=not on_gpu,
        bias_dropout_fusion=fused,
        masked_softmax_fusion=fused,
        gradient_accumulation_fusion=False,
        persist_layer_norm=fused,
        apply_rope_fusion=fused,
        **recompute_kw,
    )


def layer_spec(use_te: bool) -> ModuleSpec:
    """TransformerEngine's spec when TE is usable, else the local spec + THD CPU attention."""
    if use_te:
        return get_gpt_layer_with_transformer_engine_spec()
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = CPUCoreAttention
    return spec


def build_gpt_model(args: ModelArgs, config: TransformerConfig, *, padded_vocab: int, use_te: bool,
                    pre_process: bool, post_process: bool, pg_collection=None) -> GPTModel:
    """The GPTModel for one pipeline stage (architecture only; parallelism is in config)."""
    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(use_te),
        vocab_size=padded_vocab,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=args.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(args.rope_theta),
        pg_collection=pg_collection,
    )
