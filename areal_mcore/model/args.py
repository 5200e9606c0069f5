"""The architecture read from an HF Qwen2 / Qwen3 / LLaMA config (no megatron import).

R1-Distill-Qwen models are Qwen2: GQA, SwiGLU, RMSNorm, RoPE, bias on q/k/v only. LLaMA
is the same without the qkv bias; Qwen3 adds a per-head RMSNorm on q and k before RoPE
(megatron's ``qk_layernorm``) and states ``head_dim``, which may differ from hidden/heads.
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


ARCHITECTURES = {
    "qwen2": Architecture(qkv_bias=True, qk_norm=False),
    "llama": Architecture(qkv_bias=False, qk_norm=False),
    "qwen3": Architecture(qkv_bias=False, qk_norm=True),
}
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

    def __post_init__(self):
        if self.pipeline_split is not None:  # a JSON manifest gives a list
            object.__setattr__(self, "pipeline_split", tuple(self.pipeline_split))

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
        )


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


def folder_args(folder: str | Path) -> ModelArgs | None:
    """The architecture of an HF folder's config.json, read without transformers (the
    planner, and the checks before a run, which may run where the weights are not); None
    without a config.json."""
    config = Path(folder) / "config.json"
    return ModelArgs.from_hf(SimpleNamespace(**json.loads(config.read_text()))) if config.is_file() else None


def check_model_folder(key: str, folder: str) -> None:
    """Refuses, naming the key and the file, a model folder whose config.json the mapping
    cannot represent: run before any process starts, where the actor would only find out
    after the servers and ranks had started. A folder without config.json is the path
    checks' to report."""
    try:
        folder_args(folder)
    except ValueError as e:
        raise ValueError(f"{key}={folder}: config.json: {e}") from None
