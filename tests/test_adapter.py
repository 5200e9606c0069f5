import pytest
import torch

from areal_mcore.model import adapter
from areal_mcore.model.args import ModelArgs, padded_vocab_size


def _hf_model(kind: str, tie: bool):
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    cls, model_cls = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM),
                      "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[kind]
    extra = {"head_dim": 6} if kind == "qwen3" else {}  # != hidden / heads = 4
    config = cls(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64,
                 tie_word_embeddings=tie, **extra)
    torch.manual_seed(0)
    state = {k: v for k, v in model_cls(config).state_dict().items() if "rotary" not in k}
    if tie:
        state.pop("lm_head.weight", None)
    return ModelArgs.from_hf(config), state


@pytest.mark.parametrize("kind", ["qwen2", "llama", "qwen3"])
@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (4, 2), (1, 4)])
def test_from_hf_then_to_hf_round_trips_exactly(kind, tie, tp, pp):
    args, state = _hf_model(kind, tie)
    vocab = padded_vocab_size(args.vocab_size, tp, divisible_by=8)
    back = {}
    for stage in range(pp):
        shards = [adapter.from_hf(state, args, tp_rank=r, tp_size=tp, pp_rank=stage, pp_size=pp,
                                  padded_vocab=vocab) for r in range(tp)]
        for name, t in shards[0].items():  # shards are equal-sized slices
            assert all(s[name].shape == t.shape for s in shards)
        back.update(adapter.to_hf(shards, args, pp_rank=stage, pp_size=pp))
    assert set(back) == set(state)
    for name, t in state.items():
        assert torch.equal(back[name], t), name


def test_qkv_shard_holds_whole_kv_groups_in_megatron_order():
    args, state = _hf_model("qwen2", False)  # 8 heads, 4 kv groups, head_dim 4
    shard = adapter.from_hf(state, args, tp_rank=1, tp_size=2, pp_rank=0, pp_size=1, padded_vocab=64)
    qkv = shard["decoder.layers.0.self_attention.linear_qkv.weight"]
    q, k, v = (state[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv")
    d, per_group = 4, 2 * 4
    group2 = torch.cat([q[2 * per_group: 3 * per_group], k[2 * d: 3 * d], v[2 * d: 3 * d]])
    assert torch.equal(qkv[: group2.shape[0]], group2)  # rank 1 starts with kv group 2


def test_gate_up_shard_is_gate_slice_then_up_slice():
    args, state = _hf_model("llama", False)
    shard = adapter.from_hf(state, args, tp_rank=1, tp_size=2, pp_rank=0, pp_size=1, padded_vocab=64)
    fc1 = shard["decoder.layers.0.mlp.linear_fc1.weight"]
    gate, up = state["model.layers.0.mlp.gate_proj.weight"], state["model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(fc1, torch.cat([gate[24:], up[24:]]))


def test_vocab_rows_are_padded_with_zeros_and_stages_own_their_layers():
    args, state = _hf_model("qwen2", False)
    last = adapter.from_hf(state, args, tp_rank=0, tp_size=1, pp_rank=1, pp_size=2, padded_vocab=64)
    assert "embedding.word_embeddings.weight" not in last
    assert last["output_layer.weight"].shape[0] == 64
    assert last["output_layer.weight"][50:].abs().sum() == 0
    assert torch.equal(last["decoder.layers.0.input_layernorm.weight"],
                       state["model.layers.2.input_layernorm.weight"])


def test_missing_hf_weight_is_named():
    args, state = _hf_model("qwen2", False)
    del state["model.layers.3.mlp.up_proj.weight"]
    with pytest.raises(adapter.WeightMismatchError, match="model.layers.3.mlp.up_proj.weight"):
        adapter.from_hf(state, args, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, padded_vocab=64)


def test_model_args_reject_what_the_mapping_cannot_represent():
    from transformers import LlamaConfig, Qwen2Config

    with pytest.raises(ValueError, match="use_sliding_window"):
        ModelArgs.from_hf(Qwen2Config(use_sliding_window=True))
    with pytest.raises(ValueError, match="attention_bias=true"):  # o_proj's bias has no megatron place
        ModelArgs.from_hf(LlamaConfig(attention_bias=True))


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("config, line", [
    ({"model_type": "gpt2"}, "model_type='gpt2' is not supported; use one of ['qwen2', 'llama', 'qwen3', 'qwen3_moe', 'qwen2_moe']"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
     "rope_scaling.rope_type='yarn' is not supported; use one of ['default', 'llama3']"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}},  # the pre-4.45 spelling of rope_type
     "rope_scaling.rope_type='dynamic' is not supported; use one of ['default', 'llama3']"),
    ({"rope_scaling": {**LLAMA3, "low_freq_factor": 2.0}},
     "rope_scaling.low_freq_factor=2.0 is not supported with rope_type 'llama3': megatron-core's "
     "llama3 RoPE fixes it at 1.0"),
    ({"rope_scaling": {**LLAMA3, "original_max_position_embeddings": 4096}},
     "rope_scaling.original_max_position_embeddings=4096 is not supported"),
])
def test_refused_config_is_one_line_naming_the_key_and_supported_values(config, line):
    """As a config.json reads (the planner and the CLI read them so, before any process)."""
    from types import SimpleNamespace

    fields = dict(model_type="llama", vocab_size=50, hidden_size=32, num_hidden_layers=2,
                  num_attention_heads=4, intermediate_size=48, rms_norm_eps=1e-6,
                  max_position_embeddings=131072, rope_theta=500000.0)
    with pytest.raises(ValueError) as err:
        ModelArgs.from_hf(SimpleNamespace(**{**fields, **config}))
    assert line in str(err.value) and "\n" not in str(err.value)


def test_model_args_read_llama3_rope_from_old_and_new_configs():
    """Llama 3.1's config.json says rope_scaling + rope_theta; transformers 5 rope_parameters."""
    from types import SimpleNamespace

    from transformers import LlamaConfig

    new = ModelArgs.from_hf(LlamaConfig(rope_parameters={**LLAMA3, "rope_theta": 500000.0},
                                        max_position_embeddings=131072))
    old = ModelArgs.from_hf(SimpleNamespace(
        model_type="llama", vocab_size=128256, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, intermediate_size=14336, rms_norm_eps=1e-5, max_position_embeddings=131072,
        rope_theta=500000.0, rope_scaling={**LLAMA3, "factor": 32.0}, attention_bias=False, mlp_bias=False))
    assert (new.rope_scaling_factor, new.rope_theta, new.qkv_bias, new.qk_norm) == (8.0, 500000.0, False, False)
    assert (old.rope_scaling_factor, old.rope_theta, old.head_dim) == (32.0, 500000.0, 128)
    plain = ModelArgs.from_hf(LlamaConfig())
    assert plain.rope_scaling_factor is None


def test_model_args_read_qwen3_fields():
    from transformers import Qwen3Config

    args = ModelArgs.from_hf(Qwen3Config(hidden_size=1024, num_attention_heads=16, num_key_value_heads=8,
                                         head_dim=128, rope_theta=1e6))
    assert (args.head_dim, args.qk_norm, args.qkv_bias, args.rope_theta) == (128, True, False, 1e6)


def test_manifest_model_args_from_before_qk_norm_still_load():
    """Checkpoint manifests store ModelArgs as a dict; older ones lack the newer fields."""
    import dataclasses

    from transformers import Qwen2Config

    args = ModelArgs.from_hf(Qwen2Config())
    old = {k: v for k, v in dataclasses.asdict(args).items() if k not in ("qk_norm", "rope_scaling_factor")}
    assert ModelArgs(**old) == args


def test_model_args_read_qwen2_fields():
    from transformers import Qwen2Config

    args = ModelArgs.from_hf(Qwen2Config(vocab_size=151936, hidden_size=3584, num_attention_heads=28,
                                         num_key_value_heads=4, rope_theta=1e6, rms_norm_eps=1e-6))
    assert (args.head_dim, args.num_kv_heads, args.rope_theta, args.qkv_bias) == (128, 4, 1e6, True)
    assert padded_vocab_size(151936, 4) == 152064


def _te_spec_worker(rank, world, arch):
    from _te_standin import te_spec_on_cpu
    from _tiny_model import tiny_model

    from areal_mcore.actor.config import ParallelConfig
    from areal_mcore.actor.parallel import init_parallel
    from areal_mcore.model.hf_config import build_gpt_model, transformer_config

    hf_config, state, hf = tiny_model(arch, vocab=250)
    args = ModelArgs.from_hf(hf_config)
    init_parallel(ParallelConfig(), seed=1)
    # The actor's TE spec runs an MoE model's experts as grouped GEMMs (TEGroupedMLP).
    config = transformer_config(args, tp_size=1, pp_size=1, params_dtype=torch.float32,
                                moe_grouped_gemm=bool(args.num_experts))
    vocab = padded_vocab_size(args.vocab_size, 1, divisible_by=8)
    with te_spec_on_cpu():
        model = build_gpt_model(args, config, padded_vocab=vocab, use_te=True, pre_process=True,
                                post_process=True).eval()
    adapter.copy_into(model, adapter.from_hf(state, args, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1,
                                             padded_vocab=vocab))
    weights = {n: p.detach() for n, p in adapter.module_weights(model).items()}
    back = adapter.to_hf([weights], args, pp_rank=0, pp_size=1)
    ids = torch.randint(0, 250, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = model(ids, torch.arange(12)[None], attention_mask=None)[0, :, :250]
        want = hf(ids).logits[0]
    local = build_gpt_model(args, config, padded_vocab=vocab, use_te=False, pre_process=True, post_process=True)
    # Grouped experts' checkpoint keys come from TE's GroupedLinear, not stood in (_te_standin.py).
    saved = [sorted(v.key for v in m.sharded_state_dict().values()
                    if "_extra_state" not in v.key and ".mlp.experts." not in v.key) for m in (model, local)]
    return ([n for n, _ in model.named_parameters()], {k: torch.equal(back[k], v) for k, v in state.items()},
            float((got - want).abs().max()), saved)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "qwen3_moe", "qwen2_moe"])
def test_the_te_specs_fused_norm_weights_load_from_hf_and_export_back(arch):
    """TransformerEngine's spec names the layer norms after the linear they are fused into
    (``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``); Qwen3's q/k norms
    stay modules of their own. Built here from megatron's own TE spec with CPU stand-ins of
    TE's modules (tests/_te_standin.py): HF weights load into it, export back bitwise and
    give transformers' logits. Its MoE experts are megatron's TEGroupedMLP, whose GEMMs name
    expert e's weights ``mlp.experts.linear_fc{1,2}.weight{e}``."""
    from _dist import run_gloo
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    # megatron's own map between the two specs' names (its checkpoints use it) is ours
    local = get_gpt_layer_local_spec(normalization="RMSNorm")
    assert local.submodules.sharded_state_dict_keys_map == adapter.TE_FUSED_NORMS
    names, exported, err, (te_keys, local_keys) = run_gloo(_te_spec_worker, 1, arch)[0]
    assert te_keys == local_keys  # a checkpoint saved on either spec loads on the other
    moe = arch.endswith("_moe")
    dense = 2 if moe else 0  # tests/_tiny_model.py MOE: layer 2 is dense
    assert {f"decoder.layers.{dense}.self_attention.linear_qkv.layer_norm_weight",
            f"decoder.layers.{dense}.mlp.linear_fc1.layer_norm_weight"} <= set(names)
    assert not [n for n in names if "input_layernorm" in n]
    # An MoE layer has no linear_fc1 to fuse its pre-MLP norm into: TE's spec keeps the
    # norm a module of its own (gpt_layer_specs.py, get_gpt_layer_with_transformer_engine_spec).
    unfused = sorted(n for n in names if "pre_mlp_layernorm" in n)
    assert unfused == ([f"decoder.layers.{i}.pre_mlp_layernorm.weight" for i in (0, 1, 3)]
                       if moe else [])
    qk = {"decoder.layers.0.self_attention.q_layernorm.weight", "decoder.layers.0.self_attention.k_layernorm.weight"}
    assert (qk <= set(names)) == arch.startswith("qwen3")
    grouped = sorted(n for n in names if ".mlp.experts." in n)
    assert grouped == ([f"decoder.layers.{i}.mlp.experts.linear_fc{j}.weight{e}"
                        for i in (0, 1, 3) for j in (1, 2) for e in range(8)] if moe else [])
    shared = {f"decoder.layers.{i}.mlp.shared_experts.{w}" for i in (0, 1, 3)
              for w in ("linear_fc1.weight", "linear_fc2.weight", "gate_weight")}
    assert (shared <= set(names)) == (arch == "qwen2_moe")
    assert all(exported.values()), [k for k, ok in exported.items() if not ok]
    assert err <= 1e-4, err
