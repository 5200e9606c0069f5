"""The architecture read from an HF Qwen2 / LLaMA config (no megatron import).

R1-Distill-Qwen models are Qwen2: GQA, SwiGLU, RMSNorm, RoPE, bias on q/k/v only. LLaMA
is the same without the qkv bias (``attention_bias``). Anything the mapping cannot
represent (RoPE scaling, sliding windows, other architectures) is an error, not a
silently different model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

SUPPORTED = ("qwen2", "llama")


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
        """From a ``transformers`` config object (or anything with its attributes)."""
        if hf.model_type not in SUPPORTED:
            raise ValueError(f"model_type={hf.model_type!r} is not supported; use one of {list(SUPPORTED)}")
        rope_scaling = getattr(hf, "rope_scaling", None)
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) not in (None, "default"):
            raise ValueError(f"rope_scaling={rope_scaling} is not supported (only plain RoPE)")
        if getattr(hf, "use_sliding_window", False):
            raise ValueError("use_sliding_window=true is not supported; set it to false")
        if getattr(hf, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={hf.hidden_act!r} is not supported (only silu/SwiGLU)")
        heads = hf.num_attention_heads
        rope_theta = getattr(hf, "rope_theta", None)
        if rope_theta is None:  # transformers >= 5 keeps it in rope_parameters
            rope_theta = (getattr(hf, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
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
            rope_theta=float(rope_theta),
            qkv_bias=hf.model_type == "qwen2" or bool(getattr(hf, "attention_bias", False)),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            max_position_embeddings=hf.max_position_embeddings,
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
