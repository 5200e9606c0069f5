"""Qwen3 and Llama 3 (llama3 RoPE) in the megatron actor, against transformers.

Each architecture's tiny random model (tests/_tiny_model.py) is loaded into a real
MegatronActor at TP=2 and at PP=2 (2 gloo ranks): its weights come back to HF bitwise, and
its per-token logprobs on packed sequences equal transformers' on each sequence alone. The
llama3 sequences are long enough (100 tokens) for the scaled RoPE frequencies to matter:
with plain RoPE the logprobs differ by ~1e-2 (``qk_gain`` in _tiny_model.py).
"""

import pytest
import torch
from _actor_setup import VOCAB
from _dist import run_gloo
from _tiny_model import tiny_model

from areal_mcore.packing import pack

pytestmark = pytest.mark.multirank

LENGTHS = [100, 7, 37]  # packed into one micro-batch
SHAPE = {"qk_gain": 8.0}


def _seqs():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in LENGTHS]


def _hf_logprobs(arch: str) -> torch.Tensor:
    """transformers' per-token logprobs of each sequence alone (0 at its first token)."""
    _, _, hf = tiny_model(arch, vocab=VOCAB, **SHAPE)
    out = []
    with torch.no_grad():
        for s in _seqs():
            lp = torch.zeros(len(s))
            lp[1:] = hf(s[None]).logits[0, :-1].log_softmax(-1).gather(1, s[1:, None]).squeeze(1)
            out.append(lp)
    return torch.cat(out)


def _worker(rank, world, arch, tp, pp):
    from _actor_setup import tiny_actor

    actor = tiny_actor(tp=tp, pp=pp, arch=arch, shape=SHAPE)
    logp = actor.compute_logprobs(pack(_seqs()))
    hf = actor.hf_state_dict()  # collective over TP
    return logp, hf if actor.groups.tp_rank == 0 else {}


@pytest.fixture(scope="module", params=[(a, tp, pp) for a in ("qwen3", "llama3") for tp, pp in ((2, 1), (1, 2))],
                ids=lambda p: f"{p[0]}-tp{p[1]}-pp{p[2]}")
def loaded(request):
    arch, tp, pp = request.param
    return arch, run_gloo(_worker, 2, arch, tp, pp)


def test_hf_weights_round_trip_through_megatron_bitwise(loaded):
    arch, results = loaded
    _, state, _ = tiny_model(arch, vocab=VOCAB, **SHAPE)
    back = {}
    for _, hf in results:
        back.update(hf)
    assert set(back) == set(state)
    assert not [k for k, v in state.items() if not torch.equal(back[k], v)]


def test_packed_logprobs_equal_transformers_per_sequence(loaded):
    arch, results = loaded
    want = _hf_logprobs(arch)
    for logp, _ in results:  # every rank gets them
        assert (logp - want).abs().max() <= 1e-4
