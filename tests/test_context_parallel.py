"""Context parallelism: each packed sequence split over CP ranks gives the numbers of cp=1."""

import pytest
import torch
from _actor_setup import ppo_loss, seqs, tiny_actor, train_fields
from _dist import run_gloo

from areal_mcore.algo import ppo_actor_loss
from areal_mcore.algo.ppo_loss import reduce_ppo_stats
from areal_mcore.packing import pack
from areal_mcore.packing.cp import (
    check_cp_layout,
    cp_gather_order,
    cp_token_index,
    cp_view,
    predicts_nothing,
    shift_left,
)
from areal_mcore.trainer.sft import sft_loss
from areal_mcore.weight_sync.disk import disk_roles
from areal_mcore.weight_sync.distributed import distributed_roles


def test_each_rank_holds_one_early_and_one_late_chunk_of_every_sequence():
    # Two sequences of 8 and 4 tokens at cp=2: chunks of 2 and 1 tokens.
    assert cp_token_index([8, 4], 2, 0).tolist() == [0, 1, 6, 7, 8, 11]
    assert cp_token_index([8, 4], 2, 1).tolist() == [2, 3, 4, 5, 9, 10]
    assert cp_token_index([7, 3], 1, 0).tolist() == list(range(10))  # cp=1: any lengths, in order
    lens = [16, 8, 24]
    every = torch.cat([cp_token_index(lens, 4, r) for r in range(4)])
    assert sorted(every.tolist()) == list(range(48))  # each token on exactly one rank
    # What an all-gather over CP returns (rank 0's tokens, then rank 1's), and its inverse;
    # built once per layout (every attention layer of a micro-batch asks for it).
    order, inverse = cp_gather_order([8, 4], 2)
    assert order.tolist() == [0, 1, 6, 7, 8, 11, 2, 3, 4, 5, 9, 10]
    assert order[inverse].tolist() == list(range(12))
    assert cp_gather_order((8, 4), 2)[1] is inverse and cp_token_index([8, 4], 2, 1) is cp_token_index((8, 4), 2, 1)


def test_a_segment_that_does_not_split_evenly_is_refused_with_the_padding_to_use():
    with pytest.raises(ValueError, match=r"cp=2 .* 4 equal chunks.*segment 1 is 6 tokens.*multiple of 4"):
        check_cp_layout([8, 6], 2)


def test_shift_left_pairs_each_position_with_the_next_token_of_its_own_sequence():
    x = torch.tensor([1, 2, 3, 4, 5, 6, 7])
    # The first token has no predicting position: it goes to the one that predicts nothing.
    assert shift_left(x, [3, 4]).tolist() == [2, 3, 1, 5, 6, 7, 4]
    assert predicts_nothing([4, 8], 2, 0).tolist() == [False, True, False, False, False, True]  # chunks 0, 3


def test_a_ranks_view_holds_the_next_tokens_fields_on_its_own_layout():
    batch = pack([torch.arange(10, 18), torch.arange(20, 24)], {"f": [torch.arange(1, 9), torch.arange(11, 15)]})
    view = cp_view(batch, 2, 1, None)
    assert view.input_ids.tolist() == [12, 13, 14, 15, 21, 22]
    assert view.fields["f"].tolist() == [4, 5, 6, 7, 13, 14]  # the next token's value
    assert view.cu_seqlens_padded.tolist() == [0, 4, 6] and view.seqlens_padded == [4, 2]
    last = cp_view(batch, 2, 0, None)  # chunks 0 and 3: a sequence's last position has no next token
    assert last.fields["f"].tolist() == [2, 3, 8, 1, 12, 11]  # ... and gets its first token's
    # Each field is spread over the ranks without loss: a count on a one-token sequence (an
    # empty response after a one-token prompt) counts once under CP as without it.
    one = pack([torch.tensor([5]), torch.arange(3)], {"n": [torch.ones(1), torch.zeros(3)]}, pad_to_multiple_of=4)
    assert sum(float(cp_view(one, 2, r, None).fields["n"].sum()) for r in range(2)) == 1.0


def test_te_attention_gets_the_cp_comm_type_and_only_p2p_takes_packed_sequences():
    from _tiny_model import tiny_model

    from areal_mcore.actor.config import ParallelConfig
    from areal_mcore.model.args import ModelArgs
    from areal_mcore.model.hf_config import transformer_config

    args = ModelArgs.from_hf(tiny_model("qwen2", vocab=250)[0])
    c = transformer_config(args, tp_size=1, pp_size=1, params_dtype=torch.float32, cp_size=2,
                           cp_comm_type=ParallelConfig(cp=2).cp_comm_type)
    assert (c.context_parallel_size, c.cp_comm_type) == (2, "p2p")  # TransformerLayer passes it on
    assert transformer_config(args, tp_size=1, pp_size=1, params_dtype=torch.float32).cp_comm_type is None
    for mode in ("all_gather", "a2a"):  # TE asserts qkv_format != "thd" there
        with pytest.raises(ValueError, match=r"cp_comm_type.*take no packed \(THD\) sequences.*use p2p"):
            ParallelConfig(cp=2, cp_comm_type=mode)
    with pytest.raises(ValueError, match=r"cp_comm_type.*choose one of \['p2p'\]"):
        ParallelConfig(cp=2, cp_comm_type="ring")


def _gspo_loss(logp, mb, tokens, seqs):
    # The per-sequence path: GSPO's sequence ratio and seq-mean-token-mean, whose
    # per-sequence sums add up over the CP ranks (mb.cp_group).
    f = mb.fields
    return ppo_actor_loss(logp, f["prox"], f["adv"], f["loss_mask"], num_global_tokens=tokens, eps_clip=0.2,
                          cu_seqlens_B1=mb.cu_seqlens_padded, num_global_seqs=seqs,
                          loss_agg_mode="seq-mean-token-mean", importance_sampling_level="sequence",
                          seq_group=mb.cp_group)


def _ppo_entropy_loss(logp, mb, tokens, seqs, entropy_T):
    # Token-mean PPO with an entropy bonus: θ's entropy, per token, in the loss and its stats.
    f = mb.fields
    return ppo_actor_loss(logp, f["prox"], f["adv"], f["loss_mask"], num_global_tokens=tokens, eps_clip=0.2,
                          entropy_T=entropy_T, entropy_coef=0.05)


def _cp_and_not(rank, world, tp):
    # cp=1 and cp=world/tp on the same ranks, one launch (each launch costs ~10 s here);
    # at cp=1 the ranks beyond TP are data-parallel replicas given the same batch, which
    # trains as that batch alone (the loss is normalised over the DP ranks' tokens).
    out = []
    for cp in (1, world // tp):
        actor = tiny_actor(tp=tp, cp=cp, cap=24 // cp)  # the same tokens of the row per micro-batch
        g = actor.groups
        assert g.cp_size == cp and actor.config.context_parallel_size == cp
        s = seqs()
        logp = actor.compute_logprobs(pack(s))
        steps = [actor.train_batch(pack(s, train_fields(s)), _ppo_entropy_loss, n_minibatches=2,
                                   reduce_stats=reduce_ppo_stats, entropy=True),
                 actor.train_batch(pack(s, train_fields(s)), _gspo_loss),
                 # every token in the loss, the first too (no predicting position: its
                 # logprob is 0 and it counts, with CP as without)
                 actor.train_batch(pack(s, {"loss_mask": [torch.ones(len(x)) for x in s]}), sft_loss)]
        hf = actor.hf_state_dict()  # a gather over TP: every rank takes part
        roles = [(r.participates, r.sender, r.coordinator) for r in (distributed_roles(g), disk_roles(g))]
        out.append({"logp": logp, "loss": [x for r in steps for x in r["loss"]], "roles": roles,
                    "entropy": float(steps[0]["stats"]["entropy"]),
                    "grad_norm": [x for r in steps for x in r["grad_norm"]],
                    "n_mb": [x for r in steps for x in r["n_micro_batches"]],
                    "hf": hf if g.tp_rank == 0 else {}})
    return out


def _assert_equal(results):
    for ref, cp in results:
        assert cp["logp"].shape == ref["logp"].shape
        assert (cp["logp"] - ref["logp"]).abs().max() <= 1e-5
        if "entropy" in ref:  # the mean over the loss tokens of the first step
            assert cp["entropy"] == pytest.approx(ref["entropy"], rel=1e-5) and ref["entropy"] > 1.0
        assert all(n > 1 for n in cp["n_mb"][:2])  # several micro-batches per minibatch
        assert cp["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-7)  # (fp32: a loss near 0 keeps 1e-8)
        assert cp["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
        assert set(cp["hf"]) == set(ref["hf"])
        for name, want in ref["hf"].items():  # after three optimizer steps
            rel = (cp["hf"][name] - want).abs().max() / want.abs().max()
            assert rel <= 1e-5, f"{name}: relative difference {rel:.2e}"


@pytest.mark.multirank
def test_cp2_gives_the_logprobs_losses_and_updates_of_cp1():
    _assert_equal(run_gloo(_cp_and_not, 2, 1))


@pytest.mark.multirank
def test_cp2_tp2_with_sequence_parallelism_gives_the_numbers_of_tp2():
    results = run_gloo(_cp_and_not, 4, 2)
    _assert_equal(results)
    # CP ranks hold the same weights: only CP rank 0's TP rank 0 sends them to the servers
    # (distributed sync; both TP ranks take part in its gathers) or has the servers load
    # the export (disk sync).
    for rank, (_, cp) in enumerate(results):  # megatron's order tp-cp-dp: rank = tp + 2 cp
        tp_rank, cp_rank = rank % 2, rank // 2
        head = tp_rank == cp_rank == 0
        assert cp["roles"] == [(cp_rank == 0, head, head), (True, head, head)]


def _moe_cp_and_not(rank, world):
    # Qwen3-MoE at EP 2, cp=1 (the two ranks are data-parallel replicas given the same
    # batch) and cp=2 (EP carved out of the CP ranks), one launch: logprobs with routing
    # replay, the router disagreement, the frozen reference model's logprobs, a PPO and an
    # SFT step with the rollout's routing.
    from _actor_setup import VOCAB
    from _tiny_model import tiny_model

    from areal_mcore.actor import router_replay

    s = seqs()
    g = torch.Generator().manual_seed(3)
    routing = []
    for x in s:  # two distinct experts of 8 per token and layer; the engines' -1 on the last token
        first = torch.randint(0, 8, (len(x), 4, 1), generator=g)
        r = torch.cat([first, (first + torch.randint(1, 8, first.shape, generator=g)) % 8], -1)
        r[-1] = -1
        routing.append(r)
    _, state, _ = tiny_model("qwen3_moe", vocab=VOCAB, layers=4)
    out = []
    for cp in (1, 2):
        actor = tiny_actor(arch="qwen3_moe", ep=2, cp=cp, cap=24 // cp)
        assert (actor.groups.cp_size, actor.groups.ep_size) == (cp, 2)
        ref = actor.build_frozen_model(state)
        actor.cfg.router_replay = True
        routed = {router_replay.FIELD: routing}
        logp = actor.compute_logprobs(pack(s, routed))
        disagreement = actor.router_disagreement
        ref_logp = actor.compute_logprobs(pack(s), model=ref)
        steps = [actor.train_batch(pack(s, {**train_fields(s), **routed}), ppo_loss, n_minibatches=2),
                 actor.train_batch(pack(s, {"loss_mask": train_fields(s)["loss_mask"], **routed}), sft_loss)]
        hf = actor.hf_state_dict()  # a gather over EP: every rank takes part
        out.append({"logp": logp, "disagreement": disagreement, "ref_logp": ref_logp,
                    "loss": [x for r in steps for x in r["loss"]],
                    "grad_norm": [x for r in steps for x in r["grad_norm"]],
                    "n_mb": [x for r in steps for x in r["n_micro_batches"]], "hf": hf})
    return out


@pytest.mark.multirank
def test_cp2_ep2_moe_with_routing_replay_and_a_reference_model_gives_the_numbers_of_cp1():
    results = run_gloo(_moe_cp_and_not, 2)
    _assert_equal(results)
    for ref, cp in results:
        assert 0.3 < ref["disagreement"] < 1.0  # the replayed routing is not the routers' own
        assert cp["disagreement"] == pytest.approx(ref["disagreement"], abs=1e-9)
        assert (cp["ref_logp"] - ref["ref_logp"]).abs().max() <= 1e-5
        assert "model.layers.3.mlp.experts.7.up_proj.weight" in cp["hf"]
