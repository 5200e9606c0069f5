"""Megatron's throughput switches as config: overlapped DP grad reduce-scatter and param
all-gather give the same training as without them (DP=2 gloo ranks)."""

from __future__ import annotations

import dataclasses

import pytest
from _actor_setup import ppo_loss, seqs, tiny_actor, train_fields
from _dist import run_gloo

from areal_mcore.actor.config import ActorConfig, MicroBatchSpec, OptimizerConfig
from areal_mcore.packing import pack


def _two_steps(overlap_grad, overlap_param):
    from areal_mcore.actor.megatron_actor import MegatronActor

    base = tiny_actor(cap=24)
    cfg = dataclasses.replace(base.cfg, overlap_grad_reduce=overlap_grad, overlap_param_gather=overlap_param)
    hf = base.hf_state_dict()
    actor = MegatronActor(cfg, base.hf_config, total_optimizer_steps=4)
    actor.load_hf_state_dict(hf)
    g = actor.groups
    s = seqs()[g.dp_rank::g.dp_size]
    fields = {k: v[g.dp_rank::g.dp_size] for k, v in train_fields(seqs()).items()}
    out = [actor.train_batch(pack(s, fields), ppo_loss, n_minibatches=2) for _ in range(2)]
    return {"loss": [x for o in out for x in o["loss"]], "grad_norm": [x for o in out for x in o["grad_norm"]],
            "hf": actor.hf_state_dict(), "ddp": (actor.model.ddp_config.overlap_grad_reduce,
                                                 actor.model.ddp_config.overlap_param_gather)}


def _worker(rank, world):
    return [_two_steps(False, False), _two_steps(True, False), _two_steps(True, True)]


@pytest.mark.multirank
def test_overlapped_grad_reduce_and_param_gather_equal_plain_dp2():
    for plain, grad, both in run_gloo(_worker, 2):
        assert grad["ddp"] == (True, False) and both["ddp"] == (True, True)
        for other in (grad, both):
            assert other["loss"] == pytest.approx(plain["loss"], rel=1e-5)
            assert other["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-5)
            for name, ref in plain["hf"].items():  # after the step: the gathered, updated weights
                assert (other["hf"][name] - ref).abs().max() <= 1e-5 * ref.abs().max(), name


def test_overlap_param_gather_needs_overlap_grad_reduce():
    with pytest.raises(ValueError, match="overlap_grad_reduce"):
        ActorConfig(mb_spec=MicroBatchSpec(max_tokens_per_mb=8), optimizer=OptimizerConfig(lr=1e-3),
                    overlap_param_gather=True)
