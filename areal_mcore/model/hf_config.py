"""``ModelArgs`` -> megatron ``TransformerConfig``, layer spec and ``GPTModel``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer import transformer_block
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlock,
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig

from areal_mcore.model import mcore_compat
from areal_mcore.model.args import ModelArgs, check_expert_parallel, stage_layer_counts
from areal_mcore.model.attention import CPUCoreAttention
from areal_mcore.model.norm import SequenceParallelRMSNorm

RECOMPUTE_GRANULARITIES = ("full", "selective")


def transformer_config(args: ModelArgs, *, tp_size: int, pp_size: int, params_dtype: torch.dtype,
                       recompute: bool = False, recompute_granularity: str = "full",
                       sequence_parallel: bool = False, first_stage_layers: int | None = None,
                       last_stage_layers: int | None = None, on_gpu: bool = False,
                       fused: bool = False, gradient_accumulation_fusion: bool = False,
                       moe_aux_loss_coeff: float = 0.0, ep_size: int = 1,
                       moe_grouped_gemm: bool = False, cp_size: int = 1,
                       cp_comm_type: str = "p2p") -> TransformerConfig:
    """The megatron config for ``args`` under the given parallelism.

    ``recompute`` turns on activation recomputation: ``full`` reruns each layer's forward
    in the backward (long contexts trade a second forward for memory), ``selective``
    only the attention core (megatron's ``core_attn``). ``sequence_parallel`` shards the
    activations outside the TP regions along the tokens (needs tp > 1).
    ``first_stage_layers`` / ``last_stage_layers`` give the embedding / LM-head stages
    fewer layers (megatron's uneven pipeline split). ``fused`` turns on megatron's fused
    kernels, which need TransformerEngine/apex on a GPU. ``moe_aux_loss_coeff`` weights
    megatron's per-micro-batch load-balancing loss of an MoE model (0: none; the actor
    passes none, ``args.router_aux_loss_coef`` only records the checkpoint's value).
    ``ep_size``: expert parallelism (each rank builds ``num_experts / ep_size`` experts).
    ``moe_grouped_gemm``: an MoE layer's local experts as one grouped GEMM per projection
    (megatron's TEGroupedMLP; with TE's layer spec, block_spec reads it).
    ``cp_size``: context parallelism (the attention core exchanges K/V over the CP group),
    ``cp_comm_type`` how TE's attention does it (``ParallelConfig.cp_comm_type``).
    """
    check_expert_parallel(args, ep_size)
    stage_layer_counts(args.num_layers, pp_size, first_stage_layers, last_stage_layers)  # validates
    for name, value in (("num_attention_heads", args.num_heads), ("num_key_value_heads", args.num_kv_heads)):
        if value % tp_size:
            raise ValueError(f"{name}={value} must be divisible by tp={tp_size}")
    if recompute_granularity not in RECOMPUTE_GRANULARITIES:
        raise ValueError(f"recompute_granularity={recompute_granularity!r}: choose one of "
                         f"{list(RECOMPUTE_GRANULARITIES)}")
    recompute_kw = {}
    if recompute and recompute_granularity == "full":
        recompute_kw = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif recompute:
        recompute_kw = dict(recompute_granularity="selective", recompute_modules=["core_attn"])
    moe_kw = _moe_config(args, tp_size, moe_aux_loss_coeff, ep_size, moe_grouped_gemm) if args.num_experts else {}
    uneven_kw = {}
    if pp_size > 1:  # megatron rejects these keys without pipeline parallelism
        uneven_kw = dict(num_layers_in_first_pipeline_stage=first_stage_layers,
                         num_layers_in_last_pipeline_stage=last_stage_layers)
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
        # Qwen3's per-head q/k norms. Besides the spec's q/k_layernorm modules, megatron reads
        # this in finalize_model_grads to sum their grads over TP (each rank norms its own heads).
        qk_layernorm=args.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp_size,
        pipeline_model_parallel_size=pp_size,
        context_parallel_size=cp_size,
        cp_comm_type=cp_comm_type if cp_size > 1 else None,
        sequence_parallel=sequence_parallel and tp_size > 1,
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
        gradient_accumulation_fusion=gradient_accumulation_fusion,
        persist_layer_norm=fused,
        apply_rope_fusion=fused,
        **recompute_kw,
        **uneven_kw,
        **moe_kw,
    )


def _moe_config(args: ModelArgs, tp_size: int, aux_loss_coeff: float, ep_size: int,
                grouped_gemm: bool) -> dict:
    """TransformerConfig's MoE keys reproducing transformers' Qwen3MoeSparseMoeBlock (and
    Qwen2MoeSparseMoeBlock: the same router, plus a gated shared expert).

    HF (modeling_qwen3_moe.py, Qwen3MoeTopKRouter.forward): softmax over all experts' logits
    in fp32, top-k of those probabilities, divided by their sum when norm_topk_prob.
    megatron (transformer/moe/moe_utils.py, topk_softmax_with_capacity): with
    ``moe_router_pre_softmax`` the same softmax-then-top-k without renormalising; without it,
    top-k of the logits then a softmax over those k, which is the renormalised top-k of the
    full softmax (softmax is monotone, and the common denominator cancels). No capacity
    factor: every token reaches its experts (dropless), as in HF.
    """
    if args.moe_ffn_hidden_size % tp_size:
        raise ValueError(f"moe_intermediate_size={args.moe_ffn_hidden_size} must be divisible by tp={tp_size} "
                         f"(expert tensor parallelism splits each expert like a dense MLP)")
    return dict(
        num_moe_experts=args.num_experts,
        # Read by megatron's config checks and sharded checkpoints; the layers themselves take
        # the EP group's size from the pg_collection (MoELayer.__init__). Expert-TP = TP, as
        # actor/parallel.py initialises it.
        expert_model_parallel_size=ep_size,
        expert_tensor_parallel_size=tp_size,
        moe_router_topk=args.moe_top_k,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not args.norm_topk_prob,
        moe_layer_freq=args.moe_layer_pattern(),
        # TE's spec: the local experts of a layer in one grouped GEMM per projection
        # (TEGroupedMLP), what makes 128 small experts fast on a GPU; the local spec (CPU):
        # a SequentialMLP of ordinary column/row-parallel MLPs. block_spec reads this.
        moe_grouped_gemm=grouped_gemm,
        moe_router_load_balancing_type="aux_loss" if aux_loss_coeff else "none",
        # Every router gets megatron's RouterReplay handle (router.py, TopKRouter.__init__);
        # idle (no action) it is the plain top-k. The actor arms it to replay the rollout's
        # experts (actor.router_replay) or to record its own for the disagreement stat
        # (actor/router_replay.py).
        moe_enable_routing_replay=True,
        moe_aux_loss_coeff=aux_loss_coeff,
        # Qwen2-MoE: transformers' Qwen2MoeSparseMoeBlock adds sigmoid(shared_expert_gate(x)) *
        # shared_expert(x) to the routed output; megatron's SharedExpertMLP with a gate computes
        # sigmoid(x . gate_weight) * MLP(x), added in MoELayer (shared_experts.py, moe_layer.py).
        moe_shared_expert_intermediate_size=args.shared_expert_ffn_hidden_size or None,
        moe_shared_expert_gate=args.shared_expert_ffn_hidden_size > 0,
    )


def layer_spec(use_te: bool, qk_layernorm: bool = False, num_experts: int | None = None,
               grouped_gemm: bool = False) -> ModuleSpec:
    """TransformerEngine's spec when TE is usable, else the local spec + THD CPU attention
    and an RMSNorm that supports sequence parallelism (model/norm.py says why).

    ``qk_layernorm`` adds the per-head q/k norms; both specs name them
    ``self_attention.{q,k}_layernorm.weight`` (TE does not fuse them into a linear).
    ``num_experts`` makes the MLP megatron's MoELayer: ``mlp.router`` and, with
    ``grouped_gemm`` (TE only), a TEGroupedMLP (``mlp.experts.linear_fc{1,2}.weight{e}``),
    else a SequentialMLP (``mlp.experts.local_experts.{e}``); None: a dense MLP. The adapter
    reads both (adapter.local_name)."""
    if use_te:
        return get_gpt_layer_with_transformer_engine_spec(num_experts=num_experts, moe_grouped_gemm=grouped_gemm,
                                                          qk_layernorm=qk_layernorm)
    spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False, normalization="RMSNorm",
                                    qk_layernorm=qk_layernorm)
    attention = spec.submodules.self_attention.submodules
    attention.core_attention = CPUCoreAttention
    if qk_layernorm:
        # The local spec's WrappedTorchNorm refuses sequence parallelism even here, where the
        # norm runs after linear_qkv has gathered the sequence.
        attention.q_layernorm = attention.k_layernorm = SequenceParallelRMSNorm
    spec.submodules.input_layernorm = SequenceParallelRMSNorm
    spec.submodules.pre_mlp_layernorm = SequenceParallelRMSNorm
    if num_experts:
        # The local spec saves pre_mlp_layernorm under the name TE's spec fuses it into
        # (``mlp.linear_fc1.layer_norm_``), for MoE layers too; TE's MoE layer has no fc1 to
        # fuse into and keeps ``pre_mlp_layernorm`` (gpt_layer_specs.py,
        # get_gpt_layer_with_transformer_engine_spec). Saved as TE does, a CPU (local spec)
        # checkpoint of an MoE model has the key names a GPU one has.
        keys = spec.submodules.sharded_state_dict_keys_map
        spec.submodules.sharded_state_dict_keys_map = {k: v for k, v in keys.items() if k != "pre_mlp_layernorm."}
    return spec


def block_spec(config: TransformerConfig, use_te: bool, pp_rank: int) -> ModuleSpec:
    """One pipeline stage's decoder. With the local spec the final norm is named here:
    given a bare layer spec, TransformerBlock picks its module-global ``LayerNormImpl``
    (WrappedTorchNorm without TE/apex, which refuses sequence parallelism).

    An MoE model's layers follow ``config.moe_layer_freq`` (a 0/1 list over all layers);
    this stage's slice starts after the layers megatron builds on the stages before it."""
    dense = layer_spec(use_te, config.qk_layernorm)
    n = get_num_layers_to_build(config, pp_rank=pp_rank)
    if config.num_moe_experts:
        moe = layer_spec(use_te, config.qk_layernorm, config.num_moe_experts, config.moe_grouped_gemm)
        offset = sum(get_num_layers_to_build(config, pp_rank=r) for r in range(pp_rank))
        layers = [moe if config.moe_layer_freq[offset + i] else dense for i in range(n)]
    else:
        layers = [dense] * n
    if use_te and all(spec is layers[0] for spec in layers):
        return layers[0]
    norm = transformer_block.LayerNormImpl if use_te else SequenceParallelRMSNorm  # TE: TENorm
    return ModuleSpec(module=TransformerBlock, submodules=TransformerBlockSubmodules(
        layer_specs=layers, layer_norm=norm))


def build_gpt_model(args: ModelArgs, config: TransformerConfig, *, padded_vocab: int, use_te: bool,
                    pre_process: bool, post_process: bool, pp_rank: int = 0,
                    pg_collection=None) -> GPTModel:
    """The GPTModel for one pipeline stage (architecture only; parallelism is in config)."""
    if config.num_moe_experts:
        mcore_compat.define_moe_te_gemm()
    return GPTModel(
        config=config,
        transformer_layer_spec=block_spec(config, use_te, pp_rank),
        vocab_size=padded_vocab,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=args.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(args.rope_theta),
        # Llama 3.1+: megatron's llama3 scaling; args.py refuses what it cannot express.
        rope_scaling=args.rope_scaling_factor is not None,
        rope_scaling_factor=args.rope_scaling_factor or 8.0,  # megatron's default, unused then
        pg_collection=pg_collection,
    )
