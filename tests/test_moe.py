"""Qwen3-MoE in the megatron actor, against transformers.

The tiny random Qwen3-MoE (tests/_tiny_model.py: 8 experts, top-2 renormalised, layer 2 of
4 dense) is loaded into a real MegatronActor at TP=2 and at PP=2 (2 gloo ranks, one launch
per layout for the module): its HF checkpoint-file weights (``mlp.experts.{e}.*_proj``) come
back bitwise, its per-token logprobs on packed sequences equal transformers' on each sequence
alone (same experts chosen, same renormalised weights), and one PPO batch trains the same at
TP=2 (experts split over the expert-TP group) as at PP=2 (experts whole). A third launch
checks the logprobs without norm_topk_prob (megatron's other router branch, pre-softmax),
a fourth the same at expert-parallel size 2 (each rank holding 4 of the 8 experts).
"""

from types import SimpleNamespace

import pytest
import torch
from _actor_setup import VOCAB, ppo_loss, train_fields
from _actor_setup import seqs as train_seqs
from _dist import run_gloo
from _tiny_model import MOE, eval_seqs, hf_seq_logprobs, tiny_model

from areal_mcore.model import adapter
from areal_mcore.model.args import ModelArgs
from areal_mcore.packing import pack

ARCH = "qwen3_moe"


def _hf_logprobs(shape, arch=ARCH) -> torch.Tensor:
    """transformers' per-token logprobs of each sequence alone (0 at its first token)."""
    _, _, hf = tiny_model(arch, vocab=VOCAB, **shape)
    return hf_seq_logprobs(hf, eval_seqs(VOCAB))


def _worker(rank, world, tp, pp, shape, ep=1, arch=ARCH, hf_dir=None):
    from _actor_setup import tiny_actor

    from areal_mcore.convert.save_hf import save_hf

    actor = tiny_actor(tp=tp, pp=pp, arch=arch, shape=shape, ep=ep)
    logp = actor.compute_logprobs(pack(eval_seqs(VOCAB)))
    loaded = actor.hf_state_dict()  # collective over TP (and EP)
    s = train_seqs()
    actor.train_batch(pack(s, train_fields(s)), ppo_loss, n_minibatches=2)
    trained = actor.hf_state_dict()
    if ep > 1:  # the experts this rank built: num_experts / ep of them
        loaded["local_experts"] = sum(".local_experts." in n for n in adapter.module_weights(actor.model.module))
    # The exporter's gather: the stage's weights on one rank, nothing on the others.
    held = len(actor.hf_state_dict(writer_only=True))
    if hf_dir is not None:
        save_hf(actor, hf_dir, max_shard_bytes=100_000)
    return (logp, loaded, trained, held) if actor.groups.tp_rank == 0 else (logp, {}, {}, held)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """run(tp, pp, norm, ep, arch): each rank's (logprobs, HF weights loaded, HF weights trained,
    how many HF tensors the exporter's gather left it); at EP > 1 save_hf writes to
    ``run.hf_dir(tp, ep, arch)``."""
    cache = {}

    def get(tp, pp, norm=True, ep=1, arch=ARCH):
        key = tp, pp, norm, ep, arch
        if key not in cache:
            world = max(2, tp * pp * ep)  # EP comes out of data parallelism (expert-TP = TP)
            hf_dir = get.hf_dir(tp, ep, arch) if ep > 1 else None
            cache[key] = run_gloo(_worker, world, tp, pp, _shape(norm), ep, arch, hf_dir)
        return cache[key]
    root = tmp_path_factory.mktemp("moe_exports")
    get.hf_dir = lambda tp, ep, arch: str(root / f"{arch}_tp{tp}_ep{ep}")
    return get


def _shape(norm: bool) -> dict:
    return {} if norm else {"moe": {"norm_topk_prob": False}}


def _merged(results, i):
    out = {}
    for r in results:
        out.update(r[i])
    return out


LAYOUTS = pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])


@pytest.mark.multirank
@LAYOUTS
def test_moe_hf_weights_round_trip_through_megatron_bitwise(run, tp, pp):
    _, state, _ = tiny_model(ARCH, vocab=VOCAB)
    assert "model.layers.3.mlp.experts.7.down_proj.weight" in state and "model.layers.2.mlp.gate_proj.weight" in state
    back = _merged(run(tp, pp), 1)
    assert set(back) == set(state)
    assert not [k for k, v in state.items() if not torch.equal(back[k], v)]


@pytest.mark.multirank
@pytest.mark.parametrize("tp, pp, norm", [(2, 1, True), (1, 2, True), (2, 1, False)])
def test_moe_packed_logprobs_equal_transformers_per_sequence(run, tp, pp, norm):
    """norm: norm_topk_prob, which selects megatron's moe_router_pre_softmax (off / on)."""
    want = _hf_logprobs(_shape(norm))
    for logp, *_ in run(tp, pp, norm):  # every rank gets them
        assert (logp - want).abs().max() <= 1e-4


# --------------------------------------------------------------------------- expert parallelism
# EP=2 on 2 ranks: TP=1, DP=2, each rank holds 4 of the 8 experts and the alltoall dispatcher
# sends tokens between the two data-parallel ranks. TP=2 x EP=2 takes 4 ranks: the expert
# grid is expert-TP (= TP) x EP x PP (actor/parallel.py), which must divide the world.


@pytest.mark.multirank
def test_moe_at_ep2_round_trips_hf_weights_bitwise_and_matches_transformers(run):
    """Each rank builds its own 4 experts from HF (global index ep_rank * 4 + local), and
    hf_state_dict gathers all 8 back bitwise on every rank; logprobs equal transformers'."""
    _, state, _ = tiny_model(ARCH, vocab=VOCAB)
    want = _hf_logprobs(_shape(True))
    for logp, loaded, trained, _ in run(1, 1, ep=2):
        assert loaded["local_experts"] == 3 * 4 * 2  # 3 MoE layers x 4 experts x (fc1, fc2)
        back = {k: v for k, v in loaded.items() if k != "local_experts"}
        assert set(back) == set(state) == set(trained)
        assert not [k for k, v in state.items() if not torch.equal(back[k], v)]
        assert (logp - want).abs().max() <= 1e-4


@pytest.mark.multirank
def test_moe_at_tp2_x_ep2_on_four_ranks_round_trips_matches_transformers_and_trains_as_tp2(run):
    """TP=2 x EP=2 (4 ranks, DP=2): each rank holds half of each of its 4 experts; the
    TP-rank-0 of each EP rank gathers all 8 back bitwise, logprobs equal transformers', and
    the batch (split over the two data-parallel ranks) trains the same weights as TP=2."""
    _, state, _ = tiny_model(ARCH, vocab=VOCAB)
    want = _hf_logprobs(_shape(True))
    results = run(2, 1, ep=2)
    exported = [(loaded, trained) for _, loaded, trained, _ in results if loaded]
    assert len(results) == 4 and len(exported) == 2  # the TP-rank-0 of each EP rank
    for logp, *_ in results:
        assert (logp - want).abs().max() <= 1e-4
    tp2 = _merged(run(2, 1), 2)
    for loaded, trained in exported:
        assert loaded["local_experts"] == 3 * 4 * 2  # 3 MoE layers x 4 experts x (fc1, fc2)
        back = {k: v for k, v in loaded.items() if k != "local_experts"}
        assert set(back) == set(state) == set(trained) == set(tp2)
        assert not [k for k, v in state.items() if not torch.equal(back[k], v)]
        rel = max(float((trained[k] - v).abs().max() / v.abs().max()) for k, v in tp2.items())
        assert rel <= 1e-4, rel


@pytest.mark.multirank
@pytest.mark.parametrize("arch", [ARCH, "qwen2_moe"])
def test_moe_export_at_tp2_x_ep2_gathers_on_one_rank_and_writes_the_trained_weights(run, arch):
    """save_hf at TP=2 x EP=2 writes every expert of the trained model, and its gather leaves
    the stage's weights on one rank (TP 0 of EP 0): the others hold none of them (an all-gather
    had every rank hold the whole stage on the host)."""
    from areal_mcore.convert.tools import load_hf_state_dict

    results = run(2, 1, ep=2, arch=arch)
    trained = _merged(results, 2)
    assert [held for *_, held in results] == [len(trained), 0, 0, 0]
    saved = load_hf_state_dict(run.hf_dir(2, 2, arch))
    assert set(saved) == set(trained) and all(torch.equal(saved[k], v) for k, v in trained.items())


@pytest.mark.multirank
def test_moe_train_step_at_ep2_equals_tp2(run):
    """One PPO batch at EP=2 (DP=2: the experts split over the two data-parallel ranks,
    tokens exchanged by the alltoall dispatcher) trains the same weights as at TP=2 (DP=1:
    every expert on both ranks, split over TP); both EP ranks export the same weights."""
    (_, _, ep2, _), (_, _, ep2_other, _) = run(1, 1, ep=2)
    assert not [k for k, v in ep2.items() if not torch.equal(v, ep2_other[k])]
    tp2 = _merged(run(2, 1), 2)
    _, state, _ = tiny_model(ARCH, vocab=VOCAB)
    assert set(ep2) == set(tp2) == set(state)
    assert not [k for k, v in ep2.items() if "experts" not in k and torch.equal(v, state[k])]
    # experts on the other EP rank train too (the dispatcher sent them tokens)
    assert [k for k, v in ep2.items() if ".experts.7." in k and not torch.equal(v, state[k])]
    rel = {k: float((ep2[k] - v).abs().max() / v.abs().max()) for k, v in tp2.items()}
    worst = max(rel, key=rel.get)
    print(f"EP2 vs TP2: worst {worst} {rel[worst]:.2e}")
    assert rel[worst] <= 1e-4, f"{worst}: relative difference {rel[worst]:.2e}"


@pytest.mark.multirank
def test_moe_train_step_at_tp2_equals_pp2(run):
    tp2, pp2 = _merged(run(2, 1), 2), _merged(run(1, 2), 2)
    _, state, _ = tiny_model(ARCH, vocab=VOCAB)
    assert set(tp2) == set(pp2) == set(state)
    # Routers and attention always train; an expert no training token picks keeps its weights.
    assert not [k for k, v in pp2.items() if "experts" not in k and torch.equal(v, state[k])]
    rel = {k: float((tp2[k] - v).abs().max() / v.abs().max()) for k, v in pp2.items()}
    worst = max(rel, key=rel.get)
    assert rel[worst] <= 1e-4, f"{worst}: relative difference {rel[worst]:.2e}"


# --------------------------------------------------------------------------- Qwen2-MoE
# The same experts (not renormalised, as in Qwen1.5-MoE) plus a shared expert every token
# passes, scaled by sigmoid(shared_expert_gate(x)): megatron's SharedExpertMLP with a gate.


@pytest.mark.multirank
@pytest.mark.parametrize("tp, pp, ep", [(2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 1, 2)])
def test_qwen2_moe_round_trips_bitwise_and_matches_transformers(run, tp, pp, ep):
    _, state, _ = tiny_model("qwen2_moe", vocab=VOCAB)
    assert {"model.layers.3.mlp.shared_expert.down_proj.weight", "model.layers.3.mlp.shared_expert_gate.weight",
            "model.layers.0.self_attn.q_proj.bias"} <= set(state)
    want = _hf_logprobs({}, "qwen2_moe")
    results = run(tp, pp, ep=ep, arch="qwen2_moe")
    for logp, *_ in results:
        assert (logp - want).abs().max() <= 1e-4
    back = {k: v for k, v in _merged(results, 1).items() if k != "local_experts"}
    assert set(back) == set(state)
    assert not [k for k, v in state.items() if not torch.equal(back[k], v)]


@pytest.mark.multirank
def test_qwen2_moe_train_step_is_the_same_at_tp2_pp2_and_tp2_x_ep2(run):
    """The shared expert's gate is whole on every TP rank: under sequence parallelism (on at
    TP=2) megatron sums its grads over TP (its ``sequence_parallel`` attribute)."""
    tp2 = _merged(run(2, 1, arch="qwen2_moe"), 2)
    _, state, _ = tiny_model("qwen2_moe", vocab=VOCAB)
    assert "model.layers.0.mlp.shared_expert_gate.weight" in tp2
    assert not [k for k, v in tp2.items() if ".experts." not in k and torch.equal(v, state[k])]
    for other in (_merged(run(1, 2, arch="qwen2_moe"), 2), _merged(run(2, 1, ep=2, arch="qwen2_moe"), 2)):
        assert set(other) == set(tp2)
        rel = {k: float((other[k] - v).abs().max() / v.abs().max()) for k, v in tp2.items()}
        worst = max(rel, key=rel.get)
        assert rel[worst] <= 1e-4, f"{worst}: relative difference {rel[worst]:.2e}"


# --------------------------------------------------------------------------- config mapping


def _config(arch=ARCH, **overrides):
    hf, _, _ = tiny_model(arch, vocab=VOCAB)
    return SimpleNamespace(**{**hf.to_dict(), **overrides})


def test_moe_args_read_experts_and_dense_layers_from_the_hf_config():
    args = ModelArgs.from_hf(_config(decoder_sparse_step=2, mlp_only_layers=[1]))
    assert (args.num_experts, args.moe_top_k, args.moe_ffn_hidden_size, args.norm_topk_prob) == (
        MOE["num_experts"], MOE["num_experts_per_tok"], MOE["moe_intermediate_size"], True)
    # transformers' rule: sparse iff not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0
    assert args.dense_layers == (0, 1, 2) and args.moe_layer_pattern() == [0, 0, 0, 1]
    assert ModelArgs(**{**vars(args), "dense_layers": [0, 1, 2]}) == args  # a JSON manifest's list


def test_moe_adapter_names_every_checkpoint_weight_once():
    _, state, _ = tiny_model(ARCH, vocab=VOCAB)
    names = adapter.hf_names(ModelArgs.from_hf(_config()))
    assert len(names) == len(set(names)) and set(names) == set(state)


@pytest.mark.parametrize("overrides, message", [
    ({"shared_expert_intermediate_size": 64}, "shared_expert_intermediate_size=64 is not supported"),
    ({"num_experts_per_tok": 1}, "num_experts_per_tok=1 with norm_topk_prob=true is not supported"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok=9 is not supported"),
    ({"mlp_only_layers": [4]}, "mlp_only_layers=[4] is not supported"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step=0 is not supported"),
    ({"num_experts": 0}, "num_experts=0 is not supported"),
])
def test_moe_args_refuse_an_unmappable_config_naming_the_key(overrides, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        ModelArgs.from_hf(_config(**overrides))


@pytest.mark.parametrize("overrides, message", [
    ({"shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size=0 is not supported for "
     "model_type='qwen2_moe': its MoE layers always have a shared expert; it must be >= 1"),
    ({"qkv_bias": False}, "qkv_bias=false is not supported for model_type='qwen2_moe'; supported: true"),
    ({"num_experts": 0}, "(a dense model is model_type 'qwen2')"),
])
def test_qwen2_moe_args_read_the_shared_expert_and_refuse_what_megatron_cannot_map(overrides, message):
    args = ModelArgs.from_hf(_config("qwen2_moe"))
    assert (args.shared_expert_ffn_hidden_size, args.qkv_bias, args.qk_norm, args.norm_topk_prob) == (
        48, True, False, False)
    with pytest.raises(ValueError) as err:
        ModelArgs.from_hf(_config("qwen2_moe", **overrides))
    assert message in str(err.value)


def test_moe_transformer_config_matches_hf_routing():
    from areal_mcore.model.hf_config import transformer_config

    for norm in (True, False):
        args = ModelArgs.from_hf(_config(norm_topk_prob=norm))
        c = transformer_config(args, tp_size=1, pp_size=1, params_dtype=torch.float32)
        assert (c.num_moe_experts, c.moe_router_topk, c.moe_ffn_hidden_size) == (8, 2, 32)
        # softmax over the top-k logits == the renormalised top-k of the full softmax
        assert c.moe_router_pre_softmax is (not norm) and c.moe_router_score_function == "softmax"
        assert c.moe_layer_freq == [1, 1, 0, 1] and c.moe_aux_loss_coeff == 0.0
    odd = ModelArgs.from_hf(_config(moe_intermediate_size=33))
    with pytest.raises(ValueError, match="moe_intermediate_size=33 must be divisible by tp=2"):
        transformer_config(odd, tp_size=2, pp_size=1, params_dtype=torch.float32)


@pytest.mark.parametrize("pp_rank", [0, 1])
def test_moe_weight_sync_plan_sends_every_expert_in_checkpoint_names_and_shapes(pp_rank):
    """The weight syncer's buckets come from the adapter's entries (weight_sync/buckets.py),
    so a TP=2, PP=2 plan covers this stage's experts, routers and dense MLP at HF shapes."""
    from areal_mcore.weight_sync.buckets import make_plan

    _, state, _ = tiny_model(ARCH, vocab=VOCAB)
    args = ModelArgs.from_hf(_config())
    shard = adapter.from_hf(state, args, tp_rank=0, tp_size=2, pp_rank=pp_rank, pp_size=2, padded_vocab=256)
    plan = make_plan({n: t.shape for n, t in shard.items()}, args, tp_size=2, pp_rank=pp_rank, pp_size=2,
                     dtype="float32", bucket_bytes=1 << 16)
    sent = {hf: shape for bucket in plan.buckets for unit in bucket for hf, shape in unit.hf}
    layers = range(2 * pp_rank, 2 * pp_rank + 2)
    want = {k: tuple(v.shape) for k, v in state.items()
            if any(k.startswith(f"model.layers.{i}.") for i in layers)
            or (pp_rank == 0 and k == "model.embed_tokens.weight")
            or (pp_rank == 1 and k in ("model.norm.weight", "lm_head.weight"))}
    assert sent == want


@pytest.mark.parametrize("ep_rank", [0, 1])
def test_moe_weight_sync_plan_at_ep2_names_every_expert_once(ep_rank):
    """At EP=2 a rank holds 4 local experts per MoE layer; its plan (same on both EP ranks)
    has one unit per (local expert weight, EP rank) under the global HF names: every
    expert of the stage once, at TP=2 x PP=2 x EP=2."""
    from areal_mcore.weight_sync.buckets import make_plan

    _, state, _ = tiny_model(ARCH, vocab=VOCAB)
    args = ModelArgs.from_hf(_config())
    plans = []
    for pp_rank in (0, 1):
        shard = adapter.from_hf(state, args, tp_rank=0, tp_size=2, pp_rank=pp_rank, pp_size=2, padded_vocab=256,
                                ep_rank=ep_rank, ep_size=2)
        assert sum(".local_experts." in n for n in shard) == 4 * 2 * (2 if pp_rank == 0 else 1)  # MoE layers 0, 1 | 3
        plans.append(make_plan({n: t.shape for n, t in shard.items()}, args, tp_size=2, pp_rank=pp_rank,
                               pp_size=2, dtype="float32", bucket_bytes=1 << 16, ep_size=2))
    sent = [(hf, shape) for plan in plans for bucket in plan.buckets for unit in bucket for hf, shape in unit.hf]
    assert len(sent) == len(set(sent)) == len(state)
    assert dict(sent) == {k: tuple(v.shape) for k, v in state.items()}
    units = [u for plan in plans for b in plan.buckets for u in b if u.ep_rank is not None]
    assert {u.mcore.split("local_experts.")[1].split(".")[0] for u in units} == {"0", "1", "2", "3"}
    assert all(f"experts.{4 * u.ep_rank + int(u.mcore.split('local_experts.')[1][0])}." in u.hf[0][0] for u in units)


def _ep_sync_buckets_on_fake_cuda(rank, world):
    """The distributed sync's gather and pack of an EP=2 model whose weights are on an
    (emulated) GPU, over an NCCL-like EP group, with flattened buckets (the NCCL wire)."""
    import torch.distributed as dist
    from _fake_cuda import FakeCuda, is_fake_cuda, nccl_like

    from areal_mcore.rollout.weights import ReusableBuffer
    from areal_mcore.weight_sync.buckets import make_plan
    from areal_mcore.weight_sync.distributed import DistributedSync
    from areal_mcore.weight_sync.syncer import SyncStats

    _, state, _ = tiny_model(ARCH, vocab=VOCAB)
    args = ModelArgs.from_hf(_config())
    shard = adapter.from_hf(state, args, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, padded_vocab=256,
                            ep_rank=rank, ep_size=2)
    plan = make_plan({n: t.shape for n, t in shard.items()}, args, tp_size=1, pp_rank=0, pp_size=1,
                     dtype="float32", bucket_bytes=1 << 15, ep_size=2)
    ep = dist.new_group([0, 1])
    log = nccl_like(setattr, ep)
    got, on_gpu = {}, []
    with FakeCuda():
        weights = {n: t.to("cuda") for n, t in shard.items()}
        syncer = DistributedSync.__new__(DistributedSync)  # what _gather reads of one
        syncer.g = SimpleNamespace(ep=ep, ep_rank=rank, ep_size=2, tp=None, tp_size=1, pp_rank=0, pp_size=1)
        syncer.roles = SimpleNamespace(sender=True)
        syncer.actor = SimpleNamespace(args=args, model=SimpleNamespace(module=SimpleNamespace(
            named_parameters=weights.items)))
        syncer._buffers = (ReusableBuffer("cuda"), ReusableBuffer("cuda"))
        syncer._flatten = lambda: True
        collect = syncer._collect

        def collect_on_gpu(*a):
            # No host round trip: collectives would stage a CPU tensor onto the group's
            # device and back, correct but a copy of every expert through host memory.
            parts = collect(*a)
            on_gpu.append(all(map(is_fake_cuda, parts)))
            return parts
        syncer._collect = collect_on_gpu
        for i in range(len(plan.buckets)):
            (flat,) = syncer._gather(plan, i, SyncStats())
            on_gpu.append(is_fake_cuda(flat))
            names, shapes = plan.bucket_meta(i)
            parts = flat.cpu().view(torch.float32).split([torch.Size(s).numel() for s in shapes])
            got.update({n: p.view(s) for n, p, s in zip(names, parts, shapes, strict=True)})
    return got, on_gpu, log.count("broadcast")


@pytest.mark.multirank
def test_moe_distributed_sync_at_ep2_gathers_every_expert_from_gpu_weights_over_an_nccl_like_group():
    """At EP=2 each expert weight of the other EP rank is broadcast by its owner over the EP
    group before it is packed. On a GPU that group is NCCL, which refuses CPU tensors: the
    weights here are on an emulated CUDA device (tests/_fake_cuda.py) and the EP group
    refuses anything else, as NCCL does. Every bucket comes out on the device, and every HF
    tensor of the model comes out bitwise on both EP ranks."""
    _, state, _ = tiny_model(ARCH, vocab=VOCAB)
    units = 2 * sum(".mlp.experts." in k and k.endswith("down_proj.weight") for k in state)  # fc1, fc2
    for got, on_gpu, broadcasts in run_gloo(_ep_sync_buckets_on_fake_cuda, 2):
        assert all(on_gpu) and broadcasts == units  # one per expert unit of either EP rank
        assert set(got) == set(state) and all(torch.equal(got[k], v) for k, v in state.items())


def test_moe_args_read_transformers_5_and_released_config_json_alike(tmp_path):
    """transformers 5 writes ``num_local_experts`` (Qwen3MoeConfig.attribute_map); the
    released Qwen3-MoE config.json files say ``num_experts``."""
    import json

    from areal_mcore.model.args import folder_args

    hf, _, _ = tiny_model(ARCH, vocab=VOCAB)
    hf.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert "num_local_experts" in written and "num_experts" not in written
    released = {("num_experts" if k == "num_local_experts" else k): v for k, v in written.items()}
    assert folder_args(tmp_path) == ModelArgs.from_hf(SimpleNamespace(**released)) == ModelArgs.from_hf(hf)
    assert folder_args(tmp_path).num_experts == MOE["num_experts"]


def _init_at_ep2_in_a_world_of_one(rank, world):
    from areal_mcore.actor.config import ParallelConfig
    from areal_mcore.actor.parallel import init_parallel

    with pytest.raises(ValueError, match=r"actor.parallel.ep=2: world size 1 is not divisible by tp=1 x ep=2"):
        init_parallel(ParallelConfig(ep=2), seed=1)
    return True


def test_moe_expert_parallel_size_is_refused_naming_the_key_when_it_cannot_split():
    from areal_mcore.actor.config import ParallelConfig
    from areal_mcore.checks import FieldError
    from areal_mcore.model.args import check_expert_parallel

    with pytest.raises(FieldError, match="ep"):
        ParallelConfig(ep=0)
    moe = ModelArgs.from_hf(_config())
    check_expert_parallel(moe, 8)  # one expert per rank
    with pytest.raises(ValueError, match=r"actor.parallel.ep=3 must divide the model's num_experts=8"):
        check_expert_parallel(moe, 3)
    dense, _, _ = tiny_model("qwen3", vocab=VOCAB)
    with pytest.raises(ValueError, match=r"actor.parallel.ep=2: qwen3 is a dense model"):
        check_expert_parallel(ModelArgs.from_hf(dense), 2)
    # megatron's expert grid (expert-TP x EP x PP) must divide the world (init_parallel)
    assert run_gloo(_init_at_ep2_in_a_world_of_one, 1) == [True]


def test_moe_expert_parallel_config_loads_with_either_weight_sync_when_the_allocation_agrees():
    from pathlib import Path

    from areal_mcore.config import load_config

    boba = Path(__file__).parents[1] / "configs" / "boba_7b.yaml"
    both = ["actor.parallel.ep=2", "launch.allocation=sglang:d16+megatron:d8t2e2"]  # e agrees with ep
    assert load_config(boba, both).weight_sync.mode == "distributed"
    disk = [*both, "weight_sync.mode=disk", "weight_sync.disk_dir=/tmp/x"]
    assert load_config(boba, disk).actor.parallel.ep == 2
    # EP is carved out of the data-parallel ranks: it must divide the allocation's d
    # (tests/test_launcher_allocation.py has the rest of the allocation's e)
    with pytest.raises(Exception, match=r"expert parallelism e2 must divide the data-parallel size d3"):
        load_config(boba, [*disk, "launch.allocation=sglang:d16+megatron:d3t2e2"])


def test_moe_expert_parallel_size_is_checked_against_the_model_folder_before_a_run(tmp_path):
    """cli train / the Slurm launcher check model_path's config.json before any rank starts."""
    from areal_mcore.model.args import check_model_folder

    hf, _, _ = tiny_model(ARCH, vocab=VOCAB)
    hf.save_pretrained(tmp_path / "moe")
    check_model_folder("model_path", str(tmp_path / "moe"), 2)
    with pytest.raises(ValueError, match=r"actor.parallel.ep=16 must divide the model's num_experts=8"):
        check_model_folder("model_path", str(tmp_path / "moe"), 16)
    dense, _, _ = tiny_model("qwen3", vocab=VOCAB)
    dense.save_pretrained(tmp_path / "dense")
    with pytest.raises(ValueError, match=r"actor.parallel.ep=2: qwen3 is a dense model"):
        check_model_folder("model_path", str(tmp_path / "dense"), 2)
