"""HF <-> megatron state-dict adapter for Qwen2 / Qwen3 / Qwen2-MoE / Qwen3-MoE / LLaMA, declared as data.

``PARAMS`` lists every weight once: its megatron name, its HF name(s) and a *kind*
that says how the tensors are fused and how they are split over tensor-parallel ranks.
``from_hf`` produces one (TP rank, PP stage)'s megatron shard; ``to_hf`` takes the
shards of all TP ranks of a stage and returns HF tensors. Layer indices: ``{i}`` is the
global HF layer, ``{l}`` the stage-local megatron layer; ``{e}`` is an expert.

Experts use the names of HF checkpoint files (``mlp.experts.{e}.{gate,up,down}_proj``), which
transformers >= 5 writes and reads: in memory it stacks them into 3-D ``mlp.experts.gate_up_proj``
/ ``down_proj`` (modeling_qwen3_moe.py, Qwen3MoeExperts) and converts on load and save
(conversion_mapping.py: qwen3_moe uses qwen2_moe's MergeModulelist + Concatenate;
``save_pretrained`` reverts it, core_model_loading.py ``revert_weight_conversion``).

Kinds (the only place that knows layouts):
- ``replicated``: the same tensor on every TP rank (norms, including Qwen3's per-head q/k
  norms of ``head_dim`` weights, which every head shares).
- ``column`` / ``row``: split along dim 0 / dim 1.
- ``vocab``: rows padded to the padded vocab, then split along dim 0.
- ``qkv``: q, k, v fused per kv group ([q heads of the group; k; v] per group), groups
  split over TP ranks — megatron's GQA layout for ``linear_qkv``.
- ``gate_up``: each rank holds [gate_r; up_r], its slice of gate then of up.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from areal_mcore.model.args import ModelArgs


@dataclass(frozen=True)
class ParamMap:
    mcore: str
    hf: tuple[str, ...]
    kind: str
    per_layer: bool = True
    stage: str = "any"  # "first" (embedding), "last" (final norm, lm head) or "any"
    only_if: Callable[[ModelArgs], bool] = lambda args: True
    # Per layer: whether global layer i has this weight (an MoE model's dense vs MoE layers).
    layer_if: Callable[[ModelArgs, int], bool] = lambda args, i: True
    per_expert: bool = False  # one entry per expert ``{e}`` of the layer


def _dense_mlp(args: ModelArgs, i: int) -> bool:
    return not args.is_moe_layer(i)


def _shared_expert(args: ModelArgs, i: int) -> bool:
    return args.is_moe_layer(i) and args.shared_expert_ffn_hidden_size > 0


_L = "decoder.layers.{l}."
_H = "model.layers.{i}."
PARAMS: tuple[ParamMap, ...] = (
    ParamMap("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab",
             per_layer=False, stage="first"),
    ParamMap(_L + "input_layernorm.weight", (_H + "input_layernorm.weight",), "replicated"),
    ParamMap(_L + "self_attention.linear_qkv.weight",
             tuple(_H + f"self_attn.{p}_proj.weight" for p in "qkv"), "qkv"),
    ParamMap(_L + "self_attention.linear_qkv.bias",
             tuple(_H + f"self_attn.{p}_proj.bias" for p in "qkv"), "qkv",
             only_if=lambda args: args.qkv_bias),
    ParamMap(_L + "self_attention.q_layernorm.weight", (_H + "self_attn.q_norm.weight",), "replicated",
             only_if=lambda args: args.qk_norm),
    ParamMap(_L + "self_attention.k_layernorm.weight", (_H + "self_attn.k_norm.weight",), "replicated",
             only_if=lambda args: args.qk_norm),
    ParamMap(_L + "self_attention.linear_proj.weight", (_H + "self_attn.o_proj.weight",), "row"),
    ParamMap(_L + "pre_mlp_layernorm.weight", (_H + "post_attention_layernorm.weight",), "replicated"),
    ParamMap(_L + "mlp.linear_fc1.weight", (_H + "mlp.gate_proj.weight", _H + "mlp.up_proj.weight"),
             "gate_up", layer_if=_dense_mlp),
    ParamMap(_L + "mlp.linear_fc2.weight", (_H + "mlp.down_proj.weight",), "row", layer_if=_dense_mlp),
    # MoE layers (megatron's MoELayer: TopKRouter + SequentialMLP). The router is a plain
    # parameter every TP rank holds whole (transformer/moe/router.py, Router.__init__); each
    # expert is an MLP split over the expert-TP group, which at EP=1 is the TP group, exactly
    # like a dense MLP (transformer/moe/experts.py, SequentialMLP).
    ParamMap(_L + "mlp.router.weight", (_H + "mlp.gate.weight",), "replicated", layer_if=ModelArgs.is_moe_layer),
    ParamMap(_L + "mlp.experts.local_experts.{e}.linear_fc1.weight",
             (_H + "mlp.experts.{e}.gate_proj.weight", _H + "mlp.experts.{e}.up_proj.weight"), "gate_up",
             layer_if=ModelArgs.is_moe_layer, per_expert=True),
    ParamMap(_L + "mlp.experts.local_experts.{e}.linear_fc2.weight", (_H + "mlp.experts.{e}.down_proj.weight",),
             "row", layer_if=ModelArgs.is_moe_layer, per_expert=True),
    # Qwen2-MoE's shared expert: megatron's SharedExpertMLP, an MLP over the (dense) TP group,
    # and its gate, a [1, hidden] parameter whole on every TP rank
    # (transformer/moe/shared_experts.py, SharedExpertMLP.__init__).
    ParamMap(_L + "mlp.shared_experts.linear_fc1.weight",
             (_H + "mlp.shared_expert.gate_proj.weight", _H + "mlp.shared_expert.up_proj.weight"), "gate_up",
             layer_if=_shared_expert),
    ParamMap(_L + "mlp.shared_experts.linear_fc2.weight", (_H + "mlp.shared_expert.down_proj.weight",), "row",
             layer_if=_shared_expert),
    ParamMap(_L + "mlp.shared_experts.gate_weight", (_H + "mlp.shared_expert_gate.weight",), "replicated",
             layer_if=_shared_expert),
    ParamMap("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated",
             per_layer=False, stage="last"),
    ParamMap("output_layer.weight", ("lm_head.weight",), "vocab", per_layer=False, stage="last",
             only_if=lambda args: not args.tie_word_embeddings),
)


# TransformerEngine's layer spec fuses each layer norm into the linear after it: TE's
# LayerNormLinear registers the norm's weight as ``layer_norm_weight``
# (transformer_engine/pytorch/module/layernorm_linear.py), and megatron's TE spec
# (models/gpt/gpt_layer_specs.py: ``column_parallel_layer_norm_linear()``, the input and
# pre-MLP norms ``IdentityOp``) names them ``self_attention.linear_qkv.layer_norm_weight``
# and ``mlp.linear_fc1.layer_norm_weight``. (Qwen3's q/k norms are modules of their own in
# both specs, ``self_attention.{q,k}_layernorm``, named alike.) PARAMS uses the local spec's
# names; megatron's own map between the two (the local spec's ``sharded_state_dict_keys_map``,
# which also makes checkpoints of both specs agree) is this one: tests/test_adapter.py checks it.
TE_FUSED_NORMS = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                  "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
_LAYER = re.compile(r"(decoder\.layers\.(?:\d+\.)?)(.*)")
# On a GPU the TE spec runs an MoE layer's experts as megatron's TEGroupedMLP (grouped GEMM,
# model/hf_config.py): one TE GroupedLinear per projection, which registers expert e's
# weight as ``weight{e}`` (transformer_engine/pytorch/module/grouped_linear.py; megatron's
# TEGroupedLinear keeps TE's names, extensions/transformer_engine.py). Each ``weight{e}`` has
# the layout of SequentialMLP's ``local_experts.{e}.linear_fc{1,2}.weight`` (the expert-TP
# split is done outside TE, ``explicit_expert_comm``), and megatron saves both under the
# same checkpoint keys (experts.py, TEGroupedMLP.sharded_state_dict: "interchangable with
# SequentialMLP's"), so only the in-memory name differs.
_GROUPED = re.compile(r"(.*mlp\.experts\.)(linear_fc[12]\.weight)(\d+)")


def _renamed(name: str, mapping: dict[str, str]) -> str:
    m = _LAYER.fullmatch(name)
    if m:
        for old, new in mapping.items():
            if m.group(2).startswith(old):
                return m.group(1) + new + m.group(2)[len(old):]
    return name


def te_name(name: str) -> str:
    """The TE spec's (and a checkpoint's) name of a PARAMS megatron name."""
    return _renamed(name, TE_FUSED_NORMS)


def local_name(name: str) -> str:
    """The PARAMS name of a megatron parameter name of either spec (grouped experts too)."""
    m = _GROUPED.fullmatch(name)
    if m:
        return f"{m[1]}local_experts.{m[3]}.{m[2]}"
    return _renamed(name, {te: local for local, te in TE_FUSED_NORMS.items()})


def module_weights(module: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """A megatron model's parameters under PARAMS' names, whichever spec built it."""
    return {local_name(n): p for n, p in module.named_parameters()}


def copy_into(module: torch.nn.Module, shard: dict[str, torch.Tensor]) -> None:
    """Copies one (TP rank, PP stage)'s tensors (``from_hf``) into its megatron model."""
    params = module_weights(module)
    unknown, missing = sorted(set(shard) - set(params)), sorted(set(params) - set(shard))
    if unknown or missing:
        raise KeyError(f"adapter/model mismatch: unmapped {missing[:4]}, unknown {unknown[:4]}")
    with torch.no_grad():
        for name, tensor in shard.items():
            params[name].copy_(tensor)


# --------------------------------------------------------------------------- kinds
# Each kind: shard(hf_tensors, args, rank, tp, padded_vocab) -> megatron shard, and
# merge(shards of all ranks, args) -> hf tensors.


def _cat(shards: list[torch.Tensor], dim: int) -> torch.Tensor:
    return shards[0] if len(shards) == 1 else torch.cat(shards, dim)  # no copy of a lone shard


def _qkv_split_sizes(args: ModelArgs):
    per_group_q = args.num_heads // args.num_kv_heads * args.head_dim
    return args.num_kv_heads, per_group_q, args.head_dim


def _shard_qkv(hf, args, rank, tp, _):
    q, k, v = hf
    groups, gq, d = _qkv_split_sizes(args)
    tail = q.shape[1:]
    fused = torch.cat([q.reshape(groups, gq, *tail), k.reshape(groups, d, *tail),
                       v.reshape(groups, d, *tail)], dim=1)  # [groups, gq + 2d, ...]
    return fused.chunk(tp, dim=0)[rank].reshape(-1, *tail)


def _merge_qkv(shards, args):
    groups, gq, d = _qkv_split_sizes(args)
    tail = shards[0].shape[1:]
    fused = torch.cat(shards, dim=0).reshape(groups, gq + 2 * d, *tail)
    q, k, v = fused.split([gq, d, d], dim=1)
    return [q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)]


def _shard_gate_up(hf, args, rank, tp, _):
    gate, up = hf
    return torch.cat([gate.chunk(tp, 0)[rank], up.chunk(tp, 0)[rank]], dim=0)


def _merge_gate_up(shards, args):
    halves = [s.chunk(2, dim=0) for s in shards]
    return [_cat([h[0] for h in halves], 0), _cat([h[1] for h in halves], 0)]


def _shard_vocab(hf, args, rank, tp, padded_vocab):
    (w,) = hf
    padded = torch.zeros(padded_vocab, *w.shape[1:], dtype=w.dtype)
    padded[: w.shape[0]] = w
    return padded.chunk(tp, dim=0)[rank]


_KINDS = {
    "replicated": (lambda hf, a, r, tp, _: hf[0], lambda shards, a: [shards[0]]),
    "column": (lambda hf, a, r, tp, _: hf[0].chunk(tp, 0)[r], lambda s, a: [_cat(s, 0)]),
    "row": (lambda hf, a, r, tp, _: hf[0].chunk(tp, 1)[r], lambda s, a: [_cat(s, 1)]),
    "vocab": (_shard_vocab, lambda s, a: [_cat(s, 0)[: a.vocab_size]]),
    "qkv": (_shard_qkv, _merge_qkv),
    "gate_up": (_shard_gate_up, _merge_gate_up),
}


# --------------------------------------------------------------------------- API


def stage_layers(args: ModelArgs, pp_rank: int, pp_size: int) -> range:
    """Global layer indices held by a pipeline stage: ``args.pipeline_split`` when it
    describes ``pp_size`` stages, else an equal split, as megatron does."""
    split = args.pipeline_split
    if split is not None and len(split) == pp_size:
        start = sum(split[:pp_rank])
        return range(start, start + split[pp_rank])
    per = args.num_layers // pp_size
    return range(pp_rank * per, (pp_rank + 1) * per)


def stage_entries(args: ModelArgs, pp_rank: int, pp_size: int, *, tied_copy: bool = True,
                  ep_rank: int = 0, ep_size: int = 1):
    """(ParamMap, megatron name, HF names) for every weight on this stage.

    Experts: expert-parallel rank ``ep_rank`` of ``ep_size`` holds ``num_experts / ep_size``
    of them, named ``local_experts.{0..n-1}`` in megatron and by their global index
    ``ep_rank * n + local`` in HF, as megatron numbers them (transformer/moe/moe_layer.py,
    MoELayer.__init__: ``local_expert_indices``).

    ``tied_copy=False`` leaves out the last stage's copy of a tied embedding (it is a
    module parameter but neither HF nor a checkpoint stores it separately).
    """
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    n_local = args.num_experts // ep_size
    for p in PARAMS:
        if not p.only_if(args):
            continue
        if (p.stage == "first" and not first) or (p.stage == "last" and not last):
            continue
        if p.per_layer:
            for local, i in enumerate(stage_layers(args, pp_rank, pp_size)):
                if not p.layer_if(args, i):
                    continue
                for e in range(n_local) if p.per_expert else (None,):
                    hf_e = None if e is None else ep_rank * n_local + e
                    yield p, p.mcore.format(l=local, e=e), tuple(h.format(i=i, e=hf_e) for h in p.hf)
        else:
            yield p, p.mcore, p.hf
    # A tied lm head lives in the first stage's embedding; megatron keeps a copy in the
    # last stage's output layer when the two are different stages.
    if tied_copy and args.tie_word_embeddings and last and not first:
        yield PARAMS[0], "output_layer.weight", PARAMS[0].hf


class WeightMismatchError(ValueError):
    """A checkpoint's weights do not fit the model: a user error (the wrong folder, or
    another architecture or size than its config.json says), not a bug."""


def from_hf(state_dict: dict[str, torch.Tensor], args: ModelArgs, *, tp_rank: int, tp_size: int,
            pp_rank: int, pp_size: int, padded_vocab: int, ep_rank: int = 0,
            ep_size: int = 1) -> dict[str, torch.Tensor]:
    """The megatron state dict of one (TP rank, PP stage, EP rank) from a full HF state dict."""
    entries = list(stage_entries(args, pp_rank, pp_size, ep_rank=ep_rank, ep_size=ep_size))
    missing = [h for _, _, hf in entries for h in hf if h not in state_dict]
    if missing:
        raise WeightMismatchError(f"HF checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}: is it the "
                                  f"model its config.json describes (same architecture, layers and size)?")
    out = {}
    for p, name, hf_names in entries:
        shard, _ = _KINDS[p.kind]
        out[name] = shard([state_dict[h] for h in hf_names], args, tp_rank, tp_size, padded_vocab).contiguous()
    return out


def to_hf(shards: list[dict[str, torch.Tensor]], args: ModelArgs, *, pp_rank: int,
          pp_size: int, only: set[str] | None = None, contiguous: bool = True,
          ep_rank: int = 0, ep_size: int = 1) -> dict[str, torch.Tensor]:
    """HF tensors of one PP stage from the megatron state dicts of all its TP ranks.

    Experts are those of expert-parallel rank ``ep_rank`` (``shards`` are that rank's), under
    their global HF names; the other weights are the same on every EP rank.

    ``only`` restricts the conversion to those megatron names (a weight-sync bucket).
    ``contiguous=False``: views where the layout allows (a lone shard, q/k/v of a fused
    weight), for a caller that copies them anyway; they share the shards' memory.
    """
    out = {}
    for p, name, hf_names in stage_entries(args, pp_rank, pp_size, tied_copy=False, ep_rank=ep_rank,
                                           ep_size=ep_size):
        if only is not None and name not in only:
            continue
        for h, t in zip(hf_names, merge(p.kind, [s[name] for s in shards], args), strict=True):
            out[h] = t.contiguous() if contiguous else t
    return out


def merge(kind: str, shards: list[torch.Tensor], args: ModelArgs) -> list[torch.Tensor]:
    """One parameter's HF tensors, in its ``ParamMap.hf`` order, from its tensor on every TP
    rank (``kind``: its ``ParamMap.kind``): views where the layout allows (a lone shard,
    q/k/v of a fused weight), else one concatenation of the shards."""
    return _KINDS[kind][1](shards, args)


def hf_names(args: ModelArgs) -> list[str]:
    """Every HF weight name of the model, in layer order."""
    return [h for _, _, hf in stage_entries(args, 0, 1) for h in hf]


def check_hf_names(names, args: ModelArgs, where: str) -> None:
    """Raises listing every missing and every unexpected HF weight name."""
    expected, present = set(hf_names(args)), set(names)
    missing, extra = sorted(expected - present), sorted(present - expected)
    if missing or extra:
        raise WeightMismatchError(f"{where}: {len(missing)} missing weights {missing[:10]}, "
                                  f"{len(extra)} unexpected weights {extra[:10]}; the weights do not match its "
                                  f"config.json (another architecture or size?): pass a complete HF model folder")
