"""A tiny actor and its training data, shared by the actor and checkpoint tests."""

import torch
from _tiny_model import tiny_model

from areal_mcore.actor.config import ActorConfig, MicroBatchSpec, OptimizerConfig, ParallelConfig
from areal_mcore.algo import ppo_actor_loss

VOCAB = 250
LENGTHS = [7, 12, 5, 9, 11, 3, 8, 10]  # two minibatches of four sequences


def seqs(lengths=LENGTHS, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]


def train_fields(seqs, seed=2):
    g = torch.Generator().manual_seed(seed)
    return {
        "loss_mask": [torch.arange(len(s)) >= 2 for s in seqs],
        "prox": [-torch.rand(len(s), generator=g) * 6 for s in seqs],
        "adv": [torch.randn(len(s), generator=g) for s in seqs],
    }


def ppo_loss(logp, mb, tokens, seqs):
    f = mb.fields
    return ppo_actor_loss(logp, f["prox"], f["adv"], f["loss_mask"], num_global_tokens=tokens,
                          eps_clip=0.2)


def tiny_actor(tp=1, pp=1, cap=4096, tie=False, recompute=False, sp="auto", layers=4,
               first_stage_layers=None, shape=None, arch="qwen2", ep=1, cp=1):
    """A MegatronActor loaded with ``tiny_model(arch)``'s weights (``shape``: its keywords)."""
    from areal_mcore.actor.megatron_actor import MegatronActor

    hf_config, state, _ = tiny_model(arch, tie=tie, vocab=VOCAB, layers=layers, **(shape or {}))
    cfg = ActorConfig(mb_spec=MicroBatchSpec(max_tokens_per_mb=cap),
                      optimizer=OptimizerConfig(lr=1e-3, eps=1e-5, weight_decay=0.01),  # boba eps
                      parallel=ParallelConfig(tp=tp, pp=pp, ep=ep, cp=cp, sequence_parallel=sp,
                                              first_stage_layers=first_stage_layers),
                      vocab_divisible_by=8, recompute=recompute)
    actor = MegatronActor(cfg, hf_config, total_optimizer_steps=2)
    actor.load_hf_state_dict(state)
    return actor


def push_once(syncer, version: int):
    """A weight syncer's whole life on this rank (every rank of the actor calls it):
    connect, one push of ``version``, close; the push's ``SyncStats``."""
    import asyncio

    async def go():
        await syncer.connect()
        stats = await syncer.push(version)
        await syncer.close()
        return stats
    return asyncio.run(go())
