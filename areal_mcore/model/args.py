"""The architecture read from an HF Qwen2 / Qwen3 / Qwen2-MoE / Qwen3-MoE / LLaMA config (no megatron import).

R1-Distill-Qwen models are Qwen2: GQA, SwiGLU, RMSNorm, RoPE, bias on q/k/v only. LLaMA
is the same without the qkv bias; Qwen3 adds a per-head RMSNorm on q and k before RoPE
(megatron's ``qk_layernorm``) and states ``head_dim``, which may differ from hidden/heads.
Qwen3-MoE is Qwen3 with a routed mixture of experts in place of the MLP in every layer
``decoder_sparse_step`` and ``mlp_only_layers`` select (no shared experts). Qwen2-MoE is
Qwen2 (qkv bias, no q/k norms) with the same routed experts plus a shared expert every
token passes, scaled by a sigmoid gate (``mlp.shared_expert``, ``mlp.shared_expert_gate``).
RoPE is plain or llama3-scaled (Llama 3.1+), as far as megatron-core expresses it. Anything
the mapping cannot represent (other RoPE scalings, sliding windows, biases megatron has no
place for, other architectures) is an error naming the key, not a silently different model.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace


@dataclass(frozen=True)
class Architecture:
    """What an HF ``model_type`` fixes about the layers (the rest is read from the config)."""

    qkv_bias: bool  # q/k/v projections carry a bias (Qwen2 always; the others never)
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (``self_attn.{q,k}_norm``)
    moe: bool = False  # routed experts (``mlp.gate`` + ``mlp.experts.{e}``) in the sparse layers
    shared_expert: bool = False  # and a gated shared expert beside them (Qwen2-MoE)


ARCHITECTURES = {
    "qwen2": Architecture(qkv_bias=True, qk_norm=False),
    "llama": Architecture(qkv_bias=False, qk_norm=False),
    "qwen3": Architecture(qkv_bias=False, qk_norm=True),
    "qwen3_moe": Architecture(qkv_bias=False, qk_norm=True, moe=True),
    "qwen2_moe": Architecture(qkv_bias=True, qk_norm=False, moe=True, shared_expert=True),
}
# The dense model_type of each MoE one (what a config without experts should say).
DENSE_OF = {"qwen3_moe": "qwen3", "qwen2_moe": "qwen2"}
SUPPORTED = tuple(ARCHITECTURES)

# megatron-core's llama3 RoPE scaling (models/common/embeddings/rotary_pos_embedding.py,
# ``RotaryEmbedding._apply_scaling``, the same in 0.16.1 and 0.19) takes only ``factor``
# from its caller (GPTModel's ``rope_scaling_factor``); the other three are fixed at the
# Llama 3.1 values below. A config with other values is refused, not approximated.
LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
ROPE_TYPES = ("default", "llama3")


def _rope_parameters(hf) -> dict:
    """RoPE settings as one dict, from transformers >= 5 (``rope_parameters``, which also
    holds ``rope_theta``) or an older config.json (``rope_scaling`` + ``rope_theta``)."""
    params = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
    if getattr(hf, "rope_theta", None) is not None:
        params.setdefault("rope_theta", hf.rope_theta)
    params.setdefault("rope_theta", 10000.0)
    # Old configs say "type"; transformers >= 4.45 says "rope_type".
    params["rope_type"] = params.get("rope_type", params.get("type")) or "default"
    return params


def _rope_scaling_factor(rope: dict) -> float | None:
    """The llama3 factor for megatron (None: plain RoPE); refuses what megatron cannot express."""
    kind = rope["rope_type"]
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope_scaling.rope_type={kind!r} is not supported; use one of {list(ROPE_TYPES)} "
                         f"(llama3 with {LLAMA3_FIXED})")
    if kind == "default":
        return None
    for key, value in LLAMA3_FIXED.items():
        if float(rope.get(key, value)) != value:
            raise ValueError(f"rope_scaling.{key}={rope[key]!r} is not supported with rope_type 'llama3': "
                             f"megatron-core's llama3 RoPE fixes it at {value} (supported: {LLAMA3_FIXED})")
    factor = float(rope.get("factor", 0.0))
    if factor < 1.0:
        raise ValueError(f"rope_scaling.factor={rope.get('factor')!r} is not supported with rope_type "
                         f"'llama3': it must be a number >= 1")
    return factor


@dataclass(frozen=True)
class ModelArgs:
    """The architecture, read once from an HF config and validated."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    rms_norm_eps: float
    rope_theta: float
    qkv_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    # Defaults keep checkpoints written before these fields existed loadable (their
    # manifests hold ModelArgs as a dict).
    qk_norm: bool = False  # Qwen3's per-head q/k RMSNorm (megatron qk_layernorm)
    rope_scaling_factor: float | None = None  # llama3 RoPE scaling factor; None: plain RoPE
    # Layers per pipeline stage when the split is uneven (actor.parallel.first_stage_layers /
    # last_stage_layers, megatron's num_layers_in_first/last_pipeline_stage); None: equal.
    # Not architecture, but every HF <-> megatron name mapping (adapter, weight sync,
    # export) needs it together with the architecture, so it travels here.
    pipeline_split: tuple[int, ...] | None = None
    # Routed experts (Qwen3-MoE); num_experts 0: a dense model (every field below unused).
    # Routing as transformers' Qwen3MoeTopKRouter: softmax over all experts' logits, the
    # moe_top_k largest, renormalised to sum 1 when norm_topk_prob.
    num_experts: int = 0
    moe_top_k: int = 0  # HF num_experts_per_tok
    moe_ffn_hidden_size: int = 0  # HF moe_intermediate_size (each expert's SwiGLU width)
    norm_topk_prob: bool = False
    # HF's load-balancing loss weight, as the checkpoint states it; HF itself adds that loss
    # only with output_router_logits. The actor does not apply it (transformer_config's
    # moe_aux_loss_coeff defaults to 0): whether RL adds it is the trainer's decision.
    router_aux_loss_coef: float = 0.0
    # Global indices of the layers of an MoE model that keep a dense MLP of ffn_hidden_size
    # (HF mlp_only_layers and the layers decoder_sparse_step skips).
    dense_layers: tuple[int, ...] = ()
    # Qwen2-MoE's shared expert in every MoE layer: a SwiGLU of this width (HF
    # shared_expert_intermediate_size) times sigmoid(shared_expert_gate(x)); 0: none.
    shared_expert_ffn_hidden_size: int = 0

    def __post_init__(self):
        for key in ("pipeline_split", "dense_layers"):  # a JSON manifest gives lists
            if getattr(self, key) is not None:
                object.__setattr__(self, key, tuple(getattr(self, key)))

    def is_moe_layer(self, layer: int) -> bool:
        """Whether global layer ``layer`` holds routed experts instead of a dense MLP."""
        return self.num_experts > 0 and layer not in self.dense_layers

    def moe_layer_pattern(self) -> list[int]:
        """megatron's ``moe_layer_freq`` as a list: 1 for an MoE layer, 0 for a dense one."""
        return [int(self.is_moe_layer(i)) for i in range(self.num_layers)]

    @classmethod
    def from_hf(cls, hf) -> ModelArgs:
        """From a ``transformers`` config object (or anything with its attributes, such as
        a config.json read into a namespace). Raises ``ValueError`` naming the key and the
        supported values for anything the megatron mapping cannot represent exactly."""
        arch = ARCHITECTURES.get(getattr(hf, "model_type", None))
        if arch is None:
            raise ValueError(f"model_type={getattr(hf, 'model_type', None)!r} is not supported; "
                             f"use one of {list(SUPPORTED)}")
        rope = _rope_parameters(hf)
        rope_scaling_factor = _rope_scaling_factor(rope)
        if getattr(hf, "use_sliding_window", False):
            raise ValueError("use_sliding_window=true is not supported; set it to false")
        if getattr(hf, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={hf.hidden_act!r} is not supported; use 'silu' (SwiGLU)")
        # LLaMA's and Qwen3's attention_bias puts a bias on o_proj as well as on q/k/v, and
        # mlp_bias on all three MLP projections: megatron's add_qkv_bias covers q/k/v only and
        # add_bias_linear every linear at once, so neither combination maps exactly.
        for key in ("attention_bias", "mlp_bias"):
            if getattr(hf, key, False):
                raise ValueError(f"{key}=true is not supported for model_type={hf.model_type!r}; "
                                 f"supported: {key}=false")
        heads = hf.num_attention_heads
        if arch.qkv_bias and getattr(hf, "qkv_bias", True) is False:  # Qwen2MoeConfig states it
            raise ValueError(f"qkv_bias=false is not supported for model_type={hf.model_type!r}; supported: true")
        moe = _moe_fields(hf, arch) if arch.moe else {}
        return cls(
            model_type=hf.model_type,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            num_layers=hf.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
            ffn_hidden_size=hf.intermediate_size,
            rms_norm_eps=hf.rms_norm_eps,
            rope_theta=float(rope["rope_theta"]),
            qkv_bias=arch.qkv_bias,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            max_position_embeddings=hf.max_position_embeddings,
            qk_norm=arch.qk_norm,
            rope_scaling_factor=rope_scaling_factor,
            **moe,
        )


def _moe_fields(hf, arch: Architecture) -> dict:
    """ModelArgs' expert fields from a Qwen3-/Qwen2-MoE config; refuses what megatron's MoE layer
    (transformer/moe/router.py TopKRouter, moe_utils.topk_softmax_with_capacity) cannot
    reproduce exactly."""
    # transformers >= 5 writes config.json with ``num_local_experts`` (Qwen3MoeConfig's
    # attribute_map aliases num_experts to it); the released Qwen3-MoE configs say num_experts.
    num_experts = getattr(hf, "num_experts", None)
    num_experts = int(getattr(hf, "num_local_experts", 0) if num_experts is None else num_experts)
    if num_experts < 1:
        raise ValueError(f"num_experts={num_experts} is not supported for model_type={hf.model_type!r}: "
                         f"it needs at least 1 expert (a dense model is model_type "
                         f"{DENSE_OF[hf.model_type]!r})")
    top_k = int(hf.num_experts_per_tok)
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok={top_k} is not supported: it must be between 1 and "
                         f"num_experts={num_experts}")
    norm = bool(getattr(hf, "norm_topk_prob", False))
    # With norm_topk_prob megatron must take the softmax after the top-k (pre_softmax off,
    # hf_config.py says why), which its TransformerConfig refuses for top-1 (a softmax over
    # one logit has no gradient); HF's weight is then exactly 1 for every token.
    if norm and top_k == 1:
        raise ValueError("num_experts_per_tok=1 with norm_topk_prob=true is not supported: megatron-core "
                         "refuses top-1 routing with the softmax after the top-k; use norm_topk_prob=false")
    # Shared experts: Qwen2MoeSparseMoeBlock always has one (megatron's SharedExpertMLP with
    # moe_shared_expert_gate: sigmoid(x . gate_weight) times the SwiGLU, as transformers);
    # Qwen3MoeSparseMoeBlock has none, so a Qwen3-MoE config stating one describes weights
    # transformers would ignore (and megatron would add).
    shared = int(getattr(hf, "shared_expert_intermediate_size", 0) or 0)
    if arch.shared_expert and shared < 1:
        raise ValueError(f"shared_expert_intermediate_size={shared} is not supported for model_type="
                         f"{hf.model_type!r}: its MoE layers always have a shared expert; it must be >= 1")
    if not arch.shared_expert and shared:
        raise ValueError(f"shared_expert_intermediate_size={shared} is not supported "
                         f"for model_type={hf.model_type!r} (it has no shared experts); supported: 0 or absent")
    step = getattr(hf, "decoder_sparse_step", None)
    step = 1 if step is None else int(step)
    if step < 1:
        raise ValueError(f"decoder_sparse_step={step} is not supported: it must be >= 1")
    layers = hf.num_hidden_layers
    mlp_only = list(getattr(hf, "mlp_only_layers", None) or [])
    if any(not 0 <= i < layers for i in mlp_only):
        raise ValueError(f"mlp_only_layers={mlp_only} is not supported: every entry must be a layer index "
                         f"in [0, {layers})")
    # transformers' Qwen3MoeDecoderLayer.__init__ (and Qwen2Moe's): sparse iff not in mlp_only_layers and
    # (i + 1) % decoder_sparse_step == 0. Any such pattern is a megatron moe_layer_freq list.
    dense = tuple(i for i in range(layers) if i in mlp_only or (i + 1) % step)
    return dict(num_experts=num_experts, moe_top_k=top_k, moe_ffn_hidden_size=int(hf.moe_intermediate_size),
                norm_topk_prob=norm, router_aux_loss_coef=float(getattr(hf, "router_aux_loss_coef", 0.0) or 0.0),
                dense_layers=dense, shared_expert_ffn_hidden_size=shared)


def args_mismatch(expected: ModelArgs, actual: ModelArgs, expected_name: str, actual_name: str) -> str | None:
    """None when equal, else one line listing every differing field."""
    a, b = dataclasses.asdict(expected), dataclasses.asdict(actual)
    diff = [f"{k}: {expected_name} {a[k]!r} vs {actual_name} {b[k]!r}" for k in a if a[k] != b[k]]
    return ", ".join(diff) or None


def padded_vocab_size(vocab_size: int, tp_size: int, divisible_by: int = 128) -> int:
    """Vocab rounded up so every TP rank holds an equal, aligned slice (megatron's rule)."""
    multiple = divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


def stage_layer_counts(num_layers: int, pp_size: int, first: int | None = None,
                       last: int | None = None) -> list[int]:
    """Layers per pipeline stage, megatron's rule (transformer_block.get_num_layers_to_build):
    the first/last stage hold ``first``/``last`` layers when set, the other stages share the
    rest equally. Raises naming the config keys when the split is impossible."""
    if pp_size == 1:
        if first is not None or last is not None:
            raise ValueError("actor.parallel.first_stage_layers/last_stage_layers need pp > 1")
        return [num_layers]
    fixed = {0: first, pp_size - 1: last}
    rest = num_layers - sum(v for v in fixed.values() if v is not None)
    free = [s for s in range(pp_size) if fixed.get(s) is None]
    if any(v is not None and v < 1 for v in fixed.values()) or rest < 0 or (free and rest % len(free)) \
            or (not free and rest) or (free and rest // len(free) < 1):
        raise ValueError(
            f"num_hidden_layers={num_layers} cannot be split over pp={pp_size} with "
            f"actor.parallel.first_stage_layers={first}, last_stage_layers={last}: the other "
            f"stages must share the remaining layers equally (at least one each)")
    return [fixed[s] if fixed.get(s) is not None else rest // len(free) for s in range(pp_size)]


def stage_layer_range(num_layers: int, pp_size: int, stage: int, first: int | None = None,
                      last: int | None = None) -> range:
    """Global indices of the layers pipeline stage ``stage`` holds (``stage_layer_counts``'s split)."""
    counts = stage_layer_counts(num_layers, pp_size, first, last)
    start = sum(counts[:stage])
    return range(start, start + counts[stage])


def folder_args(folder: str | Path) -> ModelArgs | None:
    """The architecture of an HF folder's config.json, read without transformers (the
    planner, and the checks before a run, which may run where the weights are not); None
    without a config.json."""
    config = Path(folder) / "config.json"
    return ModelArgs.from_hf(SimpleNamespace(**json.loads(config.read_text()))) if config.is_file() else None


def check_model_folder(key: str, folder: str, ep: int = 1, router_replay: bool = False) -> None:
    """Refuses, naming the key and the file, a model folder whose config.json the mapping
    cannot represent, or that ``actor.parallel.ep`` cannot split: run before any process
    starts, where the actor would only find out after the servers and ranks had started.
    A folder without config.json is the path checks' to report."""
    try:
        args = folder_args(folder)
    except ValueError as e:
        raise ValueError(f"{key}={folder}: config.json: {e}") from None
    if args is not None:
        check_expert_parallel(args, ep)
        check_router_replay(args, router_replay)


def check_router_replay(args: ModelArgs, router_replay: bool) -> None:
    """Raises naming ``actor.router_replay`` for a dense model: it has no routers to replay."""
    if router_replay and not args.num_experts:
        raise ValueError(f"actor.router_replay=true: {args.model_type} is a dense model (no experts to route); "
                         f"set actor.router_replay=false")


def check_expert_parallel(args: ModelArgs, ep_size: int, key: str = "actor.parallel.ep") -> None:
    """Raises naming ``key`` (``actor.parallel.ep``, or convert's ``--ep``) when the model cannot be split over ``ep_size``.

    megatron's MoELayer builds ``num_moe_experts // ep`` local experts per rank and only
    asserts the division, in the middle of building the model (transformer/moe/moe_layer.py,
    MoELayer.__init__), so it is refused here first, with the key to change."""
    if ep_size < 1:
        raise ValueError(f"{key}={ep_size} must be >= 1")
    if ep_size > 1 and not args.num_experts:
        raise ValueError(f"{key}={ep_size}: {args.model_type} is a dense model (no experts); set ep=1")
    if ep_size > 1 and args.num_experts % ep_size:
        raise ValueError(f"{key}={ep_size} must divide the model's num_experts={args.num_experts}")
