"""The memory arithmetic: bytes per trainer rank (per pipeline stage) and per rollout server.

Legend: T = tokens of a micro-batch, h = hidden size, q = query width (heads x head_dim),
kv = key/value width, f = FFN size, Vp = padded vocab, t = TP, s = t under sequence
parallelism else 1, b = bytes of the model dtype.

Saved activations per layer and token (elements), as megatron's layers save them:
- ``te`` (TransformerEngine spec + flash attention, the GPU path): the two norm inputs
  and normalised outputs 4h/s (TE saves its linear inputs before the SP all-gather and
  gathers again in the backward), flash attention's q, k, v and output (2q + 2kv)/t,
  SwiGLU's fc1 output, silu output and fc2 input 4f/t. Korthikanti et al. 2022's count
  (34·h per token without dropout masks and with flash attention) for this architecture.
- ``local`` (the local spec on CPU, measured with ``actor.activation_memory.SavedActivationMeter``):
  torch's composite RMSNorm saves input, normalised input and output (3h+1 each, /s),
  RoPE's cos/sin (4·head_dim per token, not sharded), SwiGLU 5f/t, and attention 4q/t +
  3kv/t + the logsumexp: model/attention.py hands SDPA 4-D inputs with ``enable_gqa``, so
  torch runs its fused CPU flash kernel (autograd node
  ScaledDotProductFlashAttentionForCpuBackward0; torch 2.13), which saves q (after
  RoPE), k (after RoPE), v (a view, so the whole fused QKV output q + 2kv), its output
  and an fp32 logsumexp per head (Hq/t · 4/b), no softmax matrix and no repeated K/V;
  linear_proj saves the output again as its input (the transposed output is copied). No
  term is quadratic in the sequence length (measured to 0.1 % at 24 and 512 tokens).
Context parallelism (cp > 1; ``T`` is then one CP rank's tokens, ``max_tokens_per_mb``,
the whole row holding cp·T; every sequence is cut into 2·cp chunks of c = L / 2cp, rank r
holding chunks r and 2cp−1−r: packing/cp.py):
- ``local`` (model/attention.py ``CPUCoreAttention._forward_cp``): K and V are all-gathered
  over the CP group (megatron ``gather_from_sequence_parallel_region``) and put in row
  order (``index_select``, which saves its int64 index of the whole row: one tensor per
  micro-batch layout, packing/cp.py ``cp_gather_order``, so 8·cp bytes per rank token once,
  not per layer); each chunk's SDPA saves slices of them, so both whole-row buffers stay saved per
  layer (2kv·cp/t per rank token), next to q and linear_proj's input (2q/t). A chunk that is
  not its sequence's first attends to more keys than queries: its bottom-right causal mask
  (``causal_lower_right``), which SDPA would materialise as [c, keys] and save, quadratic in
  the length, is not kept: that chunk's attention is recomputed in the backward
  (``torch.utils.checkpoint``), so it saves only its inputs (views of q and the gathered
  K/V). A sequence's first chunk (on CP rank 0, the rank planned: half its tokens) saves
  its output and logsumexp as without CP: (q/t + lse)/2 per rank token.
- ``te`` (TransformerEngine's THD attention, ``cp_comm_type`` p2p, the default and the
  only THD mode of TE 2.x): ``AttnFuncWithCPAndKVP2P`` (TransformerEngine
  transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py) saves q,
  one K/V chunk (``kv = p2p_comm_buffers[-1]``, the last one received: a rank's size),
  the output and the softmax statistics: per rank token what flash attention saves
  without CP. In flight, one layer at a time, its forward keeps every received K/V chunk
  in ``p2p_comm_buffers`` (cp chunks, one rank's K and V each) until the layer returns,
  and its backward two ``[2, *kv.shape]`` buffers (K/V and their gradients: 4 chunks).
  Planned conservatively: max(cp, 4) chunks of 2kv/t per rank token, added once to the
  saved peak as if they coexisted with it.
MoE layers (Qwen3-MoE, megatron-core 0.16.1's MoELayer with the alltoall dispatcher and a
SequentialMLP, ``moe_permute_fusion`` off): the attention and norms as above, and in place
of the dense SwiGLU, per routed copy (k = top-k copies of each token, f = the expert width,
E = experts; balanced routing: a rank's experts receive T·k copies on average, imbalance
above that is not modelled):
- the experts' input h: the dispatcher permutes the rank's T/s tokens k times
  (moe_utils.permute, an index_select), all-to-alls them over EP and, expert-TP being TP,
  all-gathers them over TP (token_dispatcher.py MoEAlltoAllTokenDispatcher
  .dispatch_postprocess, gather_from_sequence_parallel_region), so the first expert
  linear saves T·k rows of the full h (not /s);
- the expert SwiGLU 4f/t (te) or 5f/t (local), as a dense one, plus f/t: the experts scale
  their activation output by the routing prob (experts.py SequentialMLP.forward passes
  the permuted probs to mlp.py MLP.forward as ``per_token_scale``), and that product, not
  the GLU output, is fc2's input, so both are saved;
- the prob itself (model dtype, gathered like the tokens), and on the rank's own T/s tokens
  the permutation's int64 ``sorted_indices`` (saved by the index_select and the combine's
  scatter_add_, moe_utils.unpermute) and the router's top-k indices (int64) and scores;
- per token, not per copy: the router's logits [T/s, E] (model dtype; moe_router_dtype
  unset) and the bool routing map [E, T/s] the permutation's masked_select saves.
The all-to-all buffers themselves (autograd's all_to_all saves only the split sizes) and
the permuted copy before the all-to-all are transient, freed when the layer's forward
returns. Measured on CPU (tests/test_plan_calibration.py): 6f + h + 6 fp32 elements per
routed copy, linear in k and f. A shared expert (Qwen2-MoE, megatron's SharedExpertMLP with
a gate) saves what a dense SwiGLU of its width saves, plus the gate's product inputs: its
output h/s and the sigmoid score (shared_experts.py, SharedExpertMLP.forward).
Full recompute (megatron ``uniform``, one layer per checkpoint) keeps only each layer's
input (h/s) and rebuilds one layer at a time in the backward; selective recompute
(``core_attn``) keeps only the attention inputs and output.
1F1B keeps ``pp - stage`` micro-batches in flight on a stage (megatron's warm-up count
pp - rank - 1, plus the one in its steady state); the last stage also holds the logits
[T, Vp/t] (saved by the logprob kernel) and, in the backward, their gradient.
Model state per rank with megatron's DistributedOptimizer and our DDP settings
(grad_reduce_in_fp32): weights b·N, fp32 grad buffer 4N, fp32 main params 4N/(dp·cp)
(when b < 4) and Adam moments 8N/(dp·cp), N = parameters on this TP rank of this stage:
megatron's DDP reduces and the optimizer shards over the data-parallel group with context
parallelism (parallel_state ``get_data_parallel_group(with_context_parallel=True)``, our
``groups.dp_cp``), the CP ranks holding the same weights. Experts shard over the
expert-data-parallel group instead, dp·cp/ep ranks (megatron's expert rank generator has
no CP dimension: the EP groups are carved out of DP x CP). With a KL
reference model (``ppo.kl_coef`` > 0) another b·N: the same architecture sharded the same
way, parameters only (``MegatronActor.build_frozen_model``); its forward runs before
training, so its activations never coexist with the training step's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from areal_mcore.model.args import ModelArgs, padded_vocab_size, stage_layer_range

GiB = 1024**3
PATHS = ("te", "local")


@dataclass(frozen=True)
class TrainerShape:
    """Everything about the trainer that changes its memory (no config objects: the
    calibration test builds these directly)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1  # expert parallelism: a rank holds num_experts / ep experts
    cp: int = 1  # context parallelism: a rank holds 1/cp of every sequence (tokens_per_mb is its share)
    sequence_parallel: bool = False
    recompute: bool = False
    recompute_granularity: str = "full"
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    tokens_per_mb: int = 4096  # one rank's tokens of a micro-batch (actor.mb_spec.max_tokens_per_mb)
    n_micro_batches: int | None = None  # None: at least pp (every stage fills its 1F1B window)
    dtype_bytes: int = 2
    path: str = "te"
    vocab_divisible_by: int = 128
    weight_sync_bytes: int = 0
    margin_bytes: int = 0
    reference_model: bool = False  # ppo.kl_coef > 0: a frozen copy of the weights

    @property
    def s(self) -> int:
        return self.tp if self.sequence_parallel and self.tp > 1 else 1

    @property
    def dp_cp(self) -> int:
        """Ranks the distributed optimizer shards the (non-expert) state over: DP x CP."""
        return self.dp * self.cp

    @property
    def expert_dp(self) -> int:
        """Ranks the experts' optimizer state shards over: DP x CP / EP."""
        return max(self.dp * self.cp // self.ep, 1)


@dataclass
class RankPlan:
    """One rank's terms in bytes (name -> bytes) and how they were counted."""

    where: str
    terms: dict[str, float]
    notes: dict[str, str] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.terms.values())


def layer_params(args: ModelArgs, layer: int, tp: int = 1, ep: int = 1) -> int:
    """Parameters of global layer ``layer`` on one of ``tp`` TP ranks (and one of ``ep``
    EP ranks). The projections and the experts split over TP (the expert-TP group is the
    TP group: actor/parallel.py), the experts also over EP; the norms, Qwen3's per-head q/k
    norms and an MoE layer's router are whole on every rank."""
    h = args.hidden_size
    q, kv = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
    split = h * (q + 2 * kv) + (q + 2 * kv) * args.qkv_bias + q * h
    whole = 2 * h + 2 * args.head_dim * args.qk_norm
    if args.is_moe_layer(layer):  # the router's [experts, h]
        whole += args.num_experts * h
        # Qwen2-MoE's shared expert: a SwiGLU split over TP like a dense one, and its gate [1, h]
        split += 3 * h * args.shared_expert_ffn_hidden_size
        whole += h * (args.shared_expert_ffn_hidden_size > 0)
    else:
        split += 3 * h * args.ffn_hidden_size
    return split // tp + whole + layer_expert_params(args, layer, tp, ep)


def layer_expert_params(args: ModelArgs, layer: int, tp: int = 1, ep: int = 1) -> int:
    """Expert parameters of global layer ``layer`` on one rank: each SwiGLU of its
    ``num_experts / ep`` local experts, split over TP."""
    if not args.is_moe_layer(layer):
        return 0
    return args.num_experts // ep * 3 * args.hidden_size * args.moe_ffn_hidden_size // tp


def stage_params(args: ModelArgs, shape: TrainerShape, stage: int) -> int:
    """Parameters on one TP rank of ``stage``."""
    h, t = args.hidden_size, shape.tp
    vocab = padded_vocab_size(args.vocab_size, t, shape.vocab_divisible_by) * h // t
    n = sum(layer_params(args, i, t, shape.ep) for i in _stage_layers(args, shape, stage))
    if stage == 0:
        n += vocab
    if stage == shape.pp - 1:
        # The LM head: its own weight, or megatron's copy of a tied embedding on a last
        # stage that is not also the first.
        n += h + (vocab if not args.tie_word_embeddings or shape.pp > 1 else 0)
    return n


def stage_expert_params(args: ModelArgs, shape: TrainerShape, stage: int) -> int:
    """The expert parameters among ``stage_params`` (one rank's)."""
    return sum(layer_expert_params(args, i, shape.tp, shape.ep) for i in _stage_layers(args, shape, stage))


def _stage_layers(args: ModelArgs, shape: TrainerShape, stage: int) -> range:
    return stage_layer_range(args.num_layers, shape.pp, stage, shape.first_stage_layers, shape.last_stage_layers)


def local_attention_elements(args: ModelArgs, shape: TrainerShape) -> float:
    """Saved elements per rank token of the local spec's core attention (module docstring):
    the fused CPU flash kernel's inputs, output and fp32 logsumexp, linear_proj's input;
    under CP the whole row's gathered K/V, and output and logsumexp only for the unmasked
    first chunks (CP rank 0's, the rank planned)."""
    t, b, cp = shape.tp, shape.dtype_bytes, shape.cp
    q, kv = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
    lse = args.num_heads / t * 4 / b
    if cp == 1:
        return (4 * q + 3 * kv) / t + lse
    return (2 * q + 2 * kv * cp) / t + (q / t + lse) / 2


def layer_elements(args: ModelArgs, shape: TrainerShape, *, full: bool = False, moe: bool = False) -> float:
    """Saved activation elements per token of one layer (``full``: ignore recompute;
    ``moe``: a layer of routed experts instead of the dense SwiGLU)."""
    h, t, s, f = args.hidden_size, shape.tp, shape.s, args.ffn_hidden_size
    q, kv = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
    recompute = shape.recompute and not full
    if recompute and shape.recompute_granularity == "full":
        return h / s  # the checkpointed layer input
    selective = recompute and shape.recompute_granularity == "selective"
    if shape.path == "te":
        if moe:
            return 4 * h / s + (2 * q + 2 * kv) / t + moe_elements(args, shape)
        return 4 * h / s + (2 * q + 2 * kv + 4 * f) / t
    attention = (2 * q + 2 * kv) / t if selective else local_attention_elements(args, shape)
    ffn = moe_elements(args, shape) if moe else 5 * f / t
    return (6 * h + 2) / s + attention + 4 * args.head_dim + ffn


def moe_elements(args: ModelArgs, shape: TrainerShape) -> float:
    """Saved elements (of the model dtype) per token of an MoE layer's router, dispatcher
    and experts, in place of a dense layer's SwiGLU (module docstring; balanced routing)."""
    h, t, s, b = args.hidden_size, shape.tp, shape.s, shape.dtype_bytes
    k, f, experts = args.moe_top_k, args.moe_ffn_hidden_size, args.num_experts
    swiglu = (5 if shape.path == "te" else 6) * f / t  # the dense SwiGLU's + the prob-scaled output
    per_copy = h + swiglu + 1 + (8 + 8 + b) / b / s  # + prob; int64 sorted_indices, top-k index, score
    router = (experts + experts / b) / s  # logits + the bool routing map
    shared = 0.0
    if args.shared_expert_ffn_hidden_size:  # a dense SwiGLU on the T/s tokens, then the gate's product
        shared = (4 if shape.path == "te" else 5) * args.shared_expert_ffn_hidden_size / t + (h + 1) / s
    return k * per_copy + router + shared


def head_elements(args: ModelArgs, shape: TrainerShape) -> float:
    """Saved elements per token of the last stage's final norm, LM head and logprob."""
    vp = padded_vocab_size(args.vocab_size, shape.tp, shape.vocab_divisible_by) // shape.tp
    h = args.hidden_size
    norm = 2 * h if shape.path == "te" else 3 * h + 1
    return norm / shape.s + vp + 12  # + int64 targets, lse, mean_z per token


def cp_kv_in_flight_bytes(args: ModelArgs, shape: TrainerShape) -> float:
    """TransformerEngine's p2p ring under CP: the K/V chunks one layer keeps in flight
    (max(cp, 4) chunks of a rank's K and V; module docstring), 0 without CP or on CPU."""
    if shape.cp == 1 or shape.path != "te":
        return 0.0
    kv = args.num_kv_heads * args.head_dim
    return max(shape.cp, 4) * 2 * kv / shape.tp * shape.tokens_per_mb * shape.dtype_bytes


def stage_activation_bytes(args: ModelArgs, shape: TrainerShape, stage: int) -> tuple[float, float, str]:
    """(peak bytes saved for backward, logits-gradient bytes, note) for one stage.

    The saved peak is the end of the forward (every micro-batch in flight plus, on the last
    stage, the head) or, with full recompute, the backward of a layer: the checkpoints
    still waiting plus the one layer rebuilt (the head is freed by then). Under CP on the
    GPU, one layer's K/V ring buffers are added to it (``cp_kv_in_flight_bytes``)."""
    b, T = shape.dtype_bytes, shape.tokens_per_mb
    held = _stage_layers(args, shape, stage)
    layers, moe_layers = len(held), sum(map(args.is_moe_layer, held))
    window = shape.pp - stage
    in_flight = min(window, shape.n_micro_batches) if shape.n_micro_batches else window
    # A dense model: moe_layers 0, the same product as before MoE layers were modelled.
    per_mb = ((layers - moe_layers) * layer_elements(args, shape)
              + moe_layers * layer_elements(args, shape, moe=True)) * T * b
    if stage == 0:
        per_mb += 8 * T  # the embedding's int64 token ids
    if shape.cp > 1 and shape.path == "local" and not shape.recompute:  # (in the attention: recomputed)
        per_mb += 8 * T * shape.cp  # the gathered K/V's int64 row-order index, one per micro-batch
    forward = in_flight * per_mb
    head = logits_grad = 0.0
    if stage == shape.pp - 1:
        head = head_elements(args, shape) * T * b  # one micro-batch: 1F1B's last stage turns around
        vp = padded_vocab_size(args.vocab_size, shape.tp, shape.vocab_divisible_by) // shape.tp
        logits_grad = T * vp * b  # d logits in the backward, next to the saved logits
    peak = forward + head
    if shape.recompute and shape.recompute_granularity == "full":
        rebuilt = layer_elements(args, shape, full=True, moe=moe_layers > 0)  # the widest layer
        if moe_layers < layers:
            rebuilt = max(rebuilt, layer_elements(args, shape, full=True))
        peak = max(peak, forward + rebuilt * T * b)
    ring = cp_kv_in_flight_bytes(args, shape)
    peak += ring
    note = f"{in_flight} micro-batch(es) of {T} tokens in flight x {layers} layers"
    if shape.cp > 1:
        note = (f"{in_flight} micro-batch(es) of {T} tokens per CP rank ({T * shape.cp} of the row at CP "
                f"{shape.cp}) in flight x {layers} layers" + (f" + {ring / 2**20:.0f} MiB of K/V in TE's p2p ring"
                                                              if ring else ""))
    return peak, logits_grad, note


def trainer_rank(args: ModelArgs, shape: TrainerShape, stage: int) -> RankPlan:
    """The terms of one TP rank of ``stage``."""
    n = stage_params(args, shape, stage)
    # The distributed optimizer shards the experts' fp32 state over the expert-DP group,
    # dp x cp / ep ranks (megatron builds a separate buffer for them: DistributedDataParallel's
    # expert_parallel_buffers, over parallel_state's expert-data-parallel group); the rest
    # over DP x CP (the data-parallel group with context parallelism). So EP shrinks an
    # expert's weights and grads per rank, not its optimizer state; CP shrinks the state.
    experts = stage_expert_params(args, shape, stage)
    sharded = (n - experts) / shape.dp_cp + experts / shape.expert_dp
    b = shape.dtype_bytes
    saved, logits_grad, note = stage_activation_bytes(args, shape, stage)
    last = stage == shape.pp - 1
    terms = {
        "weights": n * b,
        "ref_weights": n * b if shape.reference_model else 0.0,
        "grads": 4.0 * n,
        "main_params": 4.0 * sharded if b < 4 else 0.0,
        "optimizer": 8.0 * sharded,
        "activations": saved,
        "logits_grad": logits_grad,
        "weight_sync": float(shape.weight_sync_bytes),
        "margin": float(shape.margin_bytes),
    }
    params = f"{n / 1e9:.3f} B params" + (
        f", {experts / 1e9:.3f} B of them experts (EP {shape.ep}; their optimizer state over "
        f"expert-DP {shape.expert_dp})" if experts else "") + (
        f"; optimizer state over DP x CP {shape.dp} x {shape.cp}" if shape.cp > 1 else "")
    notes = {"weights": params, "activations": note + (" + logits" if last else "")}
    return RankPlan(where=f"trainer stage {stage}", terms=terms, notes=notes)


def trainer_plan(args: ModelArgs, shape: TrainerShape) -> list[RankPlan]:
    """One RankPlan per pipeline stage (the TP ranks of a stage hold the same)."""
    if shape.path not in PATHS:
        raise ValueError(f"path={shape.path!r}: choose one of {list(PATHS)}")
    return [trainer_rank(args, shape, stage) for stage in range(shape.pp)]


@dataclass(frozen=True)
class ServerShape:
    tp: int
    n_servers: int
    mem_fraction_static: float
    gpu_bytes: float
    sequence_tokens: int  # prompt + max_new_tokens, capped at the context length
    concurrent_sequences: int  # over all servers: max_concurrent_rollouts x n_samples
    dtype_bytes: int = 2


def server_plan(args: ModelArgs, shape: ServerShape) -> dict:
    """One SGLang server: weights per GPU and the KV-cache left at mem_fraction_static.

    SGLang sizes its KV pool as mem_fraction_static x GPU memory minus the weights
    (``model_runner.profile_max_num_token``); KV heads are split over TP, replicated
    when TP exceeds them. A sequence of ``sequence_tokens`` needs that many KV slots.
    """
    t, b = shape.tp, shape.dtype_bytes
    weights = total_params(args) * b / t
    kv_heads = max(1, args.num_kv_heads // t)
    kv_per_token = 2 * args.num_layers * kv_heads * args.head_dim * b
    pool = shape.mem_fraction_static * shape.gpu_bytes - weights
    tokens = max(0, int(pool // kv_per_token))
    fit = tokens // shape.sequence_tokens
    wanted = -(-shape.concurrent_sequences // shape.n_servers)
    return {"where": "rollout server", "n_servers": shape.n_servers, "tp": t, "weights_per_gpu": weights, "kv_pool_per_gpu": max(pool, 0.0),
            "kv_bytes_per_token": kv_per_token, "kv_tokens": tokens, "sequences_fit": fit,
            "sequences_configured": wanted, "fits": pool > 0 and fit >= max(1, wanted)}


def total_params(args: ModelArgs) -> int:
    embed = args.vocab_size * args.hidden_size
    return (sum(layer_params(args, i) for i in range(args.num_layers))
            + embed * (1 if args.tie_word_embeddings else 2) + args.hidden_size)
