"""The actor's config: parallelism, precision, micro-batching, optimizer.

Beside the actor (megatron_actor.py) and free of megatron, so the config loader and the
launcher read it without the training stack.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from areal_mcore.checks import (
    FieldError,
    check_choice,
    check_positive,
    check_unit_interval,
    field_error,
)
from areal_mcore.kernels import KERNEL_CHOICES as KERNELS


@dataclass(kw_only=True)
class MicroBatchSpec:
    """How a batch is split into micro-batches (see ``packing.allocate_micro_batches``)."""

    max_tokens_per_mb: int
    min_mbs: int = 1
    # Micro-batch count must be a multiple of this (e.g. PP size for interleaved schedules).
    divisor: int = 1

    def __post_init__(self):
        for key in ("max_tokens_per_mb", "min_mbs", "divisor"):
            check_positive(key, getattr(self, key))


LR_SCHEDULERS = ("constant", "linear", "cosine")


@dataclass(kw_only=True)
class OptimizerConfig:
    """Adam(W) on the megatron DistributedOptimizer, with warmup + decay."""

    lr: float
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    lr_scheduler: str = "constant"
    warmup_steps_proportion: float = 0.0
    min_lr_ratio: float = 0.0
    gradient_clipping: float = 1.0

    def __post_init__(self):
        check_positive("lr", self.lr)
        check_positive("eps", self.eps)
        check_positive("weight_decay", self.weight_decay, allow_zero=True)
        check_choice("lr_scheduler", self.lr_scheduler, LR_SCHEDULERS)
        for key in ("beta1", "beta2", "warmup_steps_proportion", "min_lr_ratio"):
            check_unit_interval(key, getattr(self, key))
        check_positive("gradient_clipping", self.gradient_clipping, allow_zero=True)


SEQUENCE_PARALLEL = ("auto", "true", "false")
CP_COMM_TYPES = ("p2p",)


@dataclass(kw_only=True)
class ParallelConfig:
    """Megatron model parallelism; data parallelism is what remains of the world size."""

    tp: int = 1
    pp: int = 1
    # Expert parallelism (MoE models): each rank of an expert-parallel group holds
    # num_experts / ep whole experts and tokens travel to them (megatron's alltoall token
    # dispatcher). The EP group is carved out of the data-parallel ranks: experts are
    # split over TP exactly like a dense MLP (expert-TP = TP), so tp x ep x pp must divide
    # the world size (parallel_state.initialize_model_parallel). 1 for a dense model.
    ep: int = 1
    # Context parallelism: each packed sequence split over cp ranks (packing/cp.py), its
    # K/V exchanged in attention. The CP group lies inside the data-parallel dimension
    # (megatron's rank order tp-cp-ep-dp-pp, parallel_state.initialize_model_parallel):
    # CP ranks hold the same sequences and gradients reduce over DP x CP.
    cp: int = 1
    # How TransformerEngine's attention exchanges K/V between CP ranks on the GPU (megatron's
    # TransformerConfig.cp_comm_type, passed to TEDotProductAttention): "p2p", a ring of K/V
    # chunks overlapped with attention. TE's other modes are refused: "all_gather" and "a2a"
    # (Ulysses) assert qkv_format != "thd" in the TE 2.x releases read
    # (attention/dot_product_attention/context_parallel.py, AttnFuncWithCPAndKVAllGather and
    # AttnFuncWithCPAndQKVOA2A), and every batch here is packed (THD); "a2a+p2p" needs
    # hierarchical CP groups, which actor/parallel.py does not build. The CPU attention
    # all-gathers (the same numbers).
    cp_comm_type: str = "p2p"
    # Megatron sequence parallelism: activations outside the TP regions (norms, residual)
    # sharded over the TP ranks along the tokens. "auto": on when tp > 1 (as slime, AReaL
    # and verl run TP); "true"/"false" force it.
    sequence_parallel: str = "auto"
    # Uneven pipeline split: layers of the first (embedding) / last (LM head) stage; the
    # other stages share the rest equally. None: an equal split.
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None

    def __post_init__(self):
        check_positive("tp", self.tp)
        check_positive("pp", self.pp)
        check_positive("ep", self.ep)
        check_positive("cp", self.cp)
        if self.cp_comm_type in ("all_gather", "a2a", "a2a+p2p"):
            raise field_error("cp_comm_type", self.cp_comm_type,
                              "is not supported: TransformerEngine's all_gather and a2a context parallelism "
                              "take no packed (THD) sequences, which the trainer trains on, and a2a+p2p needs "
                              "hierarchical CP groups; use p2p")
        check_choice("cp_comm_type", self.cp_comm_type, CP_COMM_TYPES)
        self.sequence_parallel = str(self.sequence_parallel).lower()
        check_choice("sequence_parallel", self.sequence_parallel, SEQUENCE_PARALLEL)
        for key in ("first_stage_layers", "last_stage_layers"):
            if getattr(self, key) is not None:
                check_positive(key, getattr(self, key))
                if self.pp == 1:
                    raise field_error(key, getattr(self, key), "needs pp > 1; set it to null")

    @property
    def use_sequence_parallel(self) -> bool:
        """Whether SP is on (it does nothing at tp == 1, so it is off there)."""
        return self.tp > 1 and self.sequence_parallel in ("auto", "true")


DTYPES = ("float32", "bfloat16")
LAYER_SPECS = ("auto", "local", "te")
RECOMPUTE_GRANULARITIES = ("full", "selective")


@dataclass(kw_only=True)
class ActorConfig:
    """The megatron actor: parallelism, precision, micro-batching, optimizer."""

    mb_spec: MicroBatchSpec
    optimizer: OptimizerConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    dtype: str = "float32"
    # Activation recomputation for long contexts: "full" reruns each layer's forward in
    # the backward (saves only layer inputs), "selective" only the attention core.
    recompute: bool = False
    recompute_granularity: str = "full"
    # Megatron throughput switches; the defaults are megatron's and AReaL's (all off).
    # Overlap the DP grad reduce-scatter with the backward, in buckets.
    overlap_grad_reduce: bool = False
    # Overlap the DistributedOptimizer's param all-gather with the next forward (needs
    # overlap_grad_reduce); the actor completes it before weights leave (sync, export).
    overlap_param_gather: bool = False
    # Fuse the weight-gradient GEMM with the accumulation into main_grad: "auto" = where
    # apex's fused_weight_gradient_mlp_cuda imports (megatron's own linears need it under
    # either spec: accel.wgrad_fusion says why).
    gradient_accumulation_fusion: str = "auto"
    # Padded vocab = multiple of this x TP (megatron's make-vocab-size-divisible-by).
    vocab_divisible_by: int = 128
    # "auto": TransformerEngine's spec when TE imports with CUDA, else the local spec.
    layer_spec: str = "auto"
    # Fused vocab-parallel logprob (kernels/logprob.py): "auto" is Triton on GPU with
    # triton installed, the chunked torch path otherwise; both give the same numbers.
    logprob_kernel: str = "auto"
    # MoE routing replay: every forward of the actor (logprob recompute, train) routes each
    # token to the experts the rollout engine chose for it (the batch's routed_experts
    # field, from vLLM's --enable-return-routed-experts or the embedded server), through
    # megatron's RouterReplay (actor/router_replay.py). MoE models only (refused for a
    # dense one). Without the field the routers choose as usual (docs/models.md).
    router_replay: bool = False

    def __post_init__(self):
        check_choice("dtype", self.dtype, DTYPES)
        check_choice("layer_spec", self.layer_spec, LAYER_SPECS)
        check_choice("logprob_kernel", self.logprob_kernel, KERNELS)
        check_choice("recompute_granularity", self.recompute_granularity, RECOMPUTE_GRANULARITIES)
        self.gradient_accumulation_fusion = str(self.gradient_accumulation_fusion).lower()
        check_choice("gradient_accumulation_fusion", self.gradient_accumulation_fusion, SEQUENCE_PARALLEL)
        if self.overlap_param_gather and not self.overlap_grad_reduce:
            raise FieldError("overlap_param_gather", "=true needs overlap_grad_reduce=true (megatron's rule)")
        check_positive("vocab_divisible_by", self.vocab_divisible_by)
