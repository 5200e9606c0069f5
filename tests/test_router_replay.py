"""Routing replay (actor.router_replay) and the router disagreement stat, against transformers.

The tiny Qwen3-MoE (tests/_tiny_model.py) in a real MegatronActor at TP=2 (sequence
parallel: each rank's routers see half the tokens) and at PP=2 (each stage its own MoE
layers), 2 gloo ranks, one launch per layout. The routing field is laid out as vLLM returns
it (``routed_experts``: [tokens - 1, layers, top_k], the last token never forwarded, -1
there). "own" is transformers' router top-k of each sequence, which the actor's routers
reproduce; "perturbed" shifts the experts of a known third of the (token, layer) entries.
"""

import functools

import pytest
import torch
from _actor_setup import VOCAB
from _dist import run_gloo
from _tiny_model import eval_seqs, hf_seq_logprobs, task_assets, tiny_model

from areal_mcore.packing import pack

ARCH = "qwen3_moe"
FIELD = "routed_experts"
MOE_LAYERS = [0, 1, 3]  # layer 2 is dense (mlp_only_layers)


def _hf_routing(model, seq: torch.Tensor) -> torch.Tensor:
    """transformers' top-k experts of ``seq`` in the engines' layout, [n, num_layers, K]:
    -1 on the last token (the engines' rows stop one short: it was sampled, never
    forwarded), and 7s in the dense layer (the engines leave it unset; it must be ignored)."""
    with torch.no_grad():
        logits = model(seq[None], output_router_logits=True).router_logits  # per MoE layer [n, E]
    k = model.config.num_experts_per_tok
    out = torch.full((len(seq), model.config.num_hidden_layers, k), 7)
    out[:, MOE_LAYERS] = torch.stack([lg.topk(k, dim=-1).indices for lg in logits], dim=1)
    out[-1] = -1
    return out


def _perturbed(routing: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Experts + 1 (mod 8) where (token + layer) % 3 == 0 (a different set: {a, b} and
    {a+1, b+1} never coincide for 2 of 8), and the mask of those entries."""
    n, layers, _ = routing.shape
    t, ell = torch.meshgrid(torch.arange(n), torch.arange(layers), indexing="ij")
    hit = ((t + ell) % 3 == 0) & (routing >= 0).all(-1)
    hit[:, 2] = False  # the dense layer's entries are not routings
    return torch.where(hit[..., None], (routing + 1) % 8, routing), hit


@functools.cache
def _routings():
    _, _, hf = tiny_model(ARCH, vocab=VOCAB)
    own = [_hf_routing(hf, s) for s in eval_seqs(VOCAB)]
    pert = [_perturbed(r) for r in own]
    return own, [p for p, _ in pert], [h for _, h in pert]


def _forced_hf_logprobs(forced: list[torch.Tensor]) -> torch.Tensor:
    """transformers' logprobs with each sequence's experts forced to ``forced`` (the
    reference for a replay): its router's own softmax, gathered at the forced experts and
    renormalised as Qwen3MoeTopKRouter.forward renormalises its top-k (norm_topk_prob)."""
    from transformers.models.qwen3_moe import modeling_qwen3_moe as m

    _, _, hf = tiny_model(ARCH, vocab=VOCAB)
    gates = {id(layer.mlp.gate): i for i, layer in enumerate(x for x in hf.model.layers if hasattr(x.mlp, "gate"))}
    current = {}

    def forward(self, hidden_states):
        h = hidden_states.reshape(-1, self.hidden_dim)
        logits = torch.nn.functional.linear(h, self.weight)
        probs = logits.softmax(-1, dtype=torch.float)
        idx = current["experts"][:, MOE_LAYERS[gates[id(self)]]].clone()
        idx[idx < 0] = torch.topk(probs, self.top_k, dim=-1).indices[idx < 0]  # last token: its own
        val = probs.gather(1, idx)
        val = val / val.sum(-1, keepdim=True) if self.norm_topk_prob else val
        return logits, val.to(logits.dtype), idx

    out = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(m.Qwen3MoeTopKRouter, "forward", forward)
        for s, f in zip(eval_seqs(VOCAB), forced, strict=True):
            current["experts"] = f
            out.append(hf_seq_logprobs(hf, [s]))
    return torch.cat(out)


def _worker(rank, world, tp, pp, own, pert):
    from _actor_setup import tiny_actor

    actor = tiny_actor(tp=tp, pp=pp, arch=ARCH)
    seqs = eval_seqs(VOCAB)
    out = {}

    def run(name, routing):
        fields = {} if routing is None else {FIELD: routing}
        out[name] = (actor.compute_logprobs(pack(seqs, fields)), actor.router_disagreement)

    run("plain", None)
    run("own", own)
    run("pert", pert)
    actor.cfg.router_replay = True  # read at every forward
    run("replay_own", own)
    run("replay_pert", pert)
    run("replay_none", [-torch.ones_like(r) for r in own])  # a rollout without routing: the routers' own

    def mean_logp(logp, mb, tokens, seqs):  # the exact token mean of the train forward's logprobs
        return (logp * mb.fields["loss_mask"]).sum() / tokens, {}

    mask = [torch.ones(len(s), dtype=torch.bool) for s in seqs]
    out["train_pert"] = actor.train_batch(pack(seqs, {FIELD: pert, "loss_mask": mask}), mean_logp)["loss"][0]
    return out


@pytest.fixture(scope="module")
def run():
    cache = {}

    def get(tp, pp):
        if (tp, pp) not in cache:
            own, pert, _ = _routings()
            cache[tp, pp] = run_gloo(_worker, 2, tp, pp, own, pert)
        return cache[tp, pp]
    return get


LAYOUTS = pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])


@pytest.mark.multirank
@LAYOUTS
def test_replaying_the_actors_own_routing_leaves_logprobs_unchanged(run, tp, pp):
    for r in run(tp, pp):
        plain = r["plain"][0]
        assert (r["replay_own"][0] - plain).abs().max() <= 1e-6
        assert torch.equal(r["replay_none"][0], plain) and r["replay_none"][1] is None
        assert (plain - hf_seq_logprobs(tiny_model(ARCH, vocab=VOCAB)[2], eval_seqs(VOCAB))).abs().max() <= 1e-4


@pytest.mark.multirank
@LAYOUTS
def test_replaying_another_routing_equals_transformers_forced_to_it(run, tp, pp):
    """The replayed logprobs move (by far more than the tolerance) and equal transformers'
    with its routers forced to the same experts; without replay the field changes nothing.
    The train forward replays too: its token-mean logprob is the replayed one."""
    _, pert, _ = _routings()
    want = _forced_hf_logprobs(pert)
    for r in run(tp, pp):
        plain, replayed = r["plain"][0], r["replay_pert"][0]
        assert (replayed - plain).abs().max() > 1e-2
        assert (replayed - want).abs().max() <= 1e-4
        assert torch.equal(r["pert"][0], plain)
        assert abs(r["train_pert"] - float(replayed.sum()) / replayed.numel()) <= 1e-5


@pytest.mark.multirank
@LAYOUTS
def test_router_disagreement_is_zero_for_own_routing_and_the_perturbed_fraction(run, tp, pp):
    """Counted over (token, MoE layer) entries with a rollout routing (the last token of each
    sequence has none), with replay off and on; None without the field."""
    _, _, hits = _routings()
    n = sum(h.shape[0] - 1 for h in hits) * len(MOE_LAYERS)
    want = float(sum(h.sum() for h in hits)) / n
    assert 0.3 <= want <= 0.35
    for r in run(tp, pp):
        assert r["plain"][1] is None
        assert r["own"][1] == 0.0 and r["replay_own"][1] == 0.0
        assert r["pert"][1] == pytest.approx(want, abs=1e-9)


def _train_replayed(rank, world, recompute, pert):
    from _actor_setup import ppo_loss, tiny_actor, train_fields

    actor = tiny_actor(pp=world, arch=ARCH, recompute=recompute)
    actor.cfg.router_replay = True
    seqs = eval_seqs(VOCAB)
    actor.train_batch(pack(seqs, {**train_fields(seqs), FIELD: pert}), ppo_loss)
    return actor.hf_state_dict()


@pytest.mark.multirank
def test_replay_under_full_recompute_at_pp2_trains_the_same_weights():
    """With actor.recompute the backward reruns each layer's forward; at PP=2 the first
    stage has run the second micro-batch's forward before the first one's backward (1F1B),
    so the recomputation must replay the experts of its own micro-batch, not the last set
    (router_replay._RecordingReplay's queue): one replayed PPO step trains the weights it
    trains without recompute."""
    _, pert, _ = _routings()
    plain = _merged_stages(run_gloo(_train_replayed, 2, False, pert))
    recomputed = _merged_stages(run_gloo(_train_replayed, 2, True, pert))
    assert set(plain) == set(recomputed)
    rel = {k: float((plain[k] - v).abs().max() / v.abs().max()) for k, v in recomputed.items()}
    assert max(rel.values()) <= 1e-5, max(rel, key=rel.get)


def _merged_stages(results: list[dict]) -> dict:
    out = {}
    for r in results:
        out.update(r)
    return out


def test_router_replay_is_refused_for_a_dense_model_naming_the_key(tmp_path):
    from areal_mcore.model.args import ModelArgs, check_model_folder, check_router_replay

    dense, _, _ = tiny_model("qwen3", vocab=VOCAB)
    msg = r"actor.router_replay=true: qwen3 is a dense model \(no experts to route\); set actor.router_replay=false"
    with pytest.raises(ValueError, match=msg):
        check_router_replay(ModelArgs.from_hf(dense), True)
    dense.save_pretrained(tmp_path / "dense")
    with pytest.raises(ValueError, match=msg):
        check_model_folder("model_path", str(tmp_path / "dense"), 1, True)
    check_model_folder("model_path", str(tmp_path / "dense"), 1, False)
    moe, _, _ = tiny_model(ARCH, vocab=VOCAB)
    check_router_replay(ModelArgs.from_hf(moe), True)


def test_router_replay_without_the_servers_routing_is_refused_at_config_load():
    from pathlib import Path

    from areal_mcore.config import load_config

    boba = Path(__file__).parents[1] / "configs" / "boba_7b.yaml"
    with pytest.raises(Exception, match=r"actor.router_replay=true needs server.return_routed_experts=true"):
        load_config(boba, ["actor.router_replay=true"])
    cfg = load_config(boba, ["actor.router_replay=true", "server.return_routed_experts=true"])
    assert cfg.actor.router_replay and cfg.server.return_routed_experts


# --------------------------------------------------------------------------- engine side


@pytest.mark.server
def test_embedded_server_returns_sglangs_routed_experts_equal_to_transformers_routing(tmp_path):
    """Started with server.return_routed_experts (--enable-return-routed-experts), a request
    with return_routed_experts gets meta_info.routed_experts as SGLang 0.5.23 sends it (base64
    int32, [tokens - 1, num_hidden_layers, top_k]); it equals transformers' router top-k of
    the whole sequence (two prompts of different lengths prefilled together, left-padded);
    routed_experts_start_len drops prompt rows; a request that does not ask gets none. The
    client's SGLang adapter asks for them and decodes them."""
    import base64

    import numpy as np
    from _rollout import embedded_servers, http, tiny_hf_dir

    from areal_mcore.rollout.engines.sglang import EmbeddedEngine

    path = tiny_hf_dir(str(tmp_path), arch=ARCH, vocab=VOCAB)
    _, _, hf = tiny_model(ARCH, vocab=VOCAB)
    prompts = [[5, 17, 99, 3, 42, 7, 200, 11], [9, 8, 140]]
    sampling = {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True}
    with embedded_servers(path, str(tmp_path / "logs"), return_routed_experts=True) as (server,):
        a = server.address
        status, outs = http(a, "POST", "/generate", {"input_ids": prompts, "sampling_params": [sampling] * 2,
                                                     "return_routed_experts": True})
        assert status == 200, outs
        _, late = http(a, "POST", "/generate", {"input_ids": prompts[0], "sampling_params": sampling,
                                                "return_routed_experts": True, "routed_experts_start_len": 3})
        _, plain = http(a, "POST", "/generate", {"input_ids": prompts[0], "sampling_params": sampling})
        engine = EmbeddedEngine()
        _, body = engine.generate_request(server, prompts[1], _params(sampling), "r1", routed_experts=True)
        _, via = http(a, "POST", "/generate", body)
    assert "routed_experts" not in plain["meta_info"]
    for prompt, out in zip(prompts, outs, strict=True):
        seq = torch.tensor(prompt + out["output_ids"])
        got = np.frombuffer(base64.b64decode(out["meta_info"]["routed_experts"]), dtype=np.int32)
        got = torch.from_numpy(got.copy()).reshape(-1, 4, 2)
        want = _hf_routing(hf, seq)[:-1]
        assert got.shape == (len(seq) - 1, 4, 2)
        assert torch.equal(got[:, MOE_LAYERS].sort(-1).values, want[:, MOE_LAYERS].sort(-1).values)
        assert not got[:, 2].any()  # the dense layer: unset (0)
    first = np.frombuffer(base64.b64decode(outs[0]["meta_info"]["routed_experts"]), dtype=np.int32)
    late_rows = np.frombuffer(base64.b64decode(late["meta_info"]["routed_experts"]), dtype=np.int32)
    assert np.array_equal(late_rows, first[3 * 4 * 2:])
    chunk = engine.parse_generate(server, via, 5)
    assert np.array_equal(chunk.routed_experts, np.frombuffer(
        base64.b64decode(outs[1]["meta_info"]["routed_experts"]), dtype=np.int32))


@pytest.mark.server
def test_a_completion_resumed_after_a_pause_keeps_routing_for_every_token(tmp_path):
    """A pause (abort mode) mid-generation makes the client resubmit prompt + output so far;
    the resumed attempt's routing covers the whole sequence, so the Completion's is
    transformers' routing of all tokens but the last (the weights did not change)."""
    import asyncio

    from _rollout import embedded_servers, tiny_hf_dir

    from areal_mcore.rollout.client import ClientConfig, RolloutClient
    from areal_mcore.rollout.protocol import SamplingParams

    path = tiny_hf_dir(str(tmp_path), arch=ARCH, vocab=VOCAB)
    _, _, hf = tiny_model(ARCH, vocab=VOCAB)
    prompt = [5, 17, 99, 3]

    async def run(address):
        async with RolloutClient(ClientConfig(addresses=[address], return_routed_experts=True)) as client:
            chunks, parse = [], client.engine.parse_generate

            def recorded(*args):
                chunks.append(parse(*args))
                return chunks[-1]
            client.engine.parse_generate = recorded
            task = asyncio.ensure_future(client.generate(prompt, SamplingParams(
                max_new_tokens=24, ignore_eos=True, temperature=0.0)))
            await asyncio.sleep(0.4)  # a few decode steps of 0.05 s
            await client.pause("abort")
            await asyncio.sleep(0.2)
            await client.continue_()
            return await task, chunks

    with embedded_servers(path, str(tmp_path / "logs"), return_routed_experts=True,
                          extra_args=["--step-delay-s", "0.05"]) as (server,):
        c, chunks = asyncio.run(run(server.address))
    assert chunks[0].finish_reason["type"] == "abort" and 0 < len(chunks[0].output_ids) < 24  # resumed
    assert chunks[0].routed_experts is not None and len(c.output_ids) == 24
    got = torch.from_numpy(c.routed_experts.astype("int64")).reshape(-1, 4, 2)
    want = _hf_routing(hf, torch.tensor(prompt + c.output_ids))[:-1]
    assert got.shape == want.shape
    assert torch.equal(got[:, MOE_LAYERS].sort(-1).values, want[:, MOE_LAYERS].sort(-1).values)


def test_served_model_loads_per_expert_checkpoint_names_into_transformers_stacked_experts():
    """What the weight sync sends for Qwen3-MoE (the checkpoint files' per-expert names)
    lands in transformers' stacked gate_up_proj / down_proj, bitwise; a wrong shape or an
    expert past the last is refused before any copy."""
    from areal_mcore.rollout import weights as W

    _, state, src = tiny_model(ARCH, vocab=VOCAB)
    _, _, dst = tiny_model(ARCH, seed=1, vocab=VOCAB)
    W.check_weights(dst, list(state), [list(t.shape) for t in state.values()])
    assert W.load_weights(dst, state.items()) == len(state)
    for (name, a), b in zip(src.named_parameters(), dst.parameters(), strict=True):
        assert torch.equal(a, b), name
    bad = {"model.layers.0.mlp.experts.8.gate_proj.weight": [32, 64],
           "model.layers.0.mlp.experts.0.down_proj.weight": [32, 64]}
    with pytest.raises(ValueError, match=r"unknown weight 'model.layers.0.mlp.experts.8.gate_proj.weight'; "
                                         r"model.layers.0.mlp.experts.0.down_proj.weight: shape \[32, 64\]"):
        W.check_weights(dst, list(bad), list(bad.values()))


def _params(raw):
    from areal_mcore.rollout.protocol import SamplingParams

    return SamplingParams.from_json(raw)


def test_rollout_routing_reaches_the_batch_as_a_per_token_field_through_dispatch():
    """A sample's engine routing ([n - 1, layers, top_k], vLLM's uint8 or SGLang's flat
    int32) crosses the dispatcher's wire format and becomes the batch's routed_experts
    field [T, layers x top_k] (the actor views it as [T, layers, top_k]): -1 on each last
    token, and on every token of a sample without routing or with the wrong row count."""
    import numpy as np

    from areal_mcore.algo.config import PPOConfig
    from areal_mcore.rollout.trajectory import Sample
    from areal_mcore.trainer.batch import to_train_batch
    from areal_mcore.trainer.dispatch import RolloutShard

    g = np.random.default_rng(0)

    def sample(p, o, routed):
        return Sample(group=0, prompt_ids=list(range(p)), output_ids=list(range(o)), logprobs=[-1.0] * o,
                      versions=[0] * o, reward=1.0, finish_reason="stop", start_version=0, routed_experts=routed)

    a = g.integers(0, 8, (6, 4, 2)).astype(np.uint8)  # vLLM: narrowest dtype, 3-D
    b = g.integers(0, 8, (4 * 4 * 2,)).astype(np.int32)  # SGLang: flat int32
    samples = [sample(3, 4, a), sample(2, 3, b), sample(2, 2, None), sample(3, 2, a)]  # the last: 6 rows for 4
    shard = RolloutShard.from_samples(samples)
    shard = RolloutShard.from_bytes(shard.header(), shard.to_bytes())
    batch = to_train_batch(shard, PPOConfig())
    f = batch.split(batch.fields["routed_experts"])
    assert [tuple(x.shape) for x in f] == [(7, 8), (5, 8), (4, 8), (5, 8)]
    assert f[0].dtype == torch.int16
    assert torch.equal(f[0][:6], torch.from_numpy(a.reshape(6, 8).astype(np.int16))) and (f[0][6] == -1).all()
    assert torch.equal(f[1][:4].reshape(-1), torch.from_numpy(b.astype(np.int16))) and (f[1][4] == -1).all()
    assert (f[2] == -1).all() and (f[3] == -1).all()
    plain = to_train_batch(RolloutShard.from_samples([sample(3, 4, None)]), PPOConfig())
    assert "routed_experts" not in plain.fields


# --------------------------------------------------------------------------- the PPO loop


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.server
def test_ppo_with_router_replay_on_the_embedded_server_logs_the_disagreement(tmp_path):
    """Two PPO steps of a TP=2 Qwen3-MoE actor on an embedded server that returns routing:
    the routing crosses client, controller, dispatch and packing into every actor forward,
    moe/router_disagreement is logged each step (0: transformers and megatron route alike,
    also after the distributed weight sync: per-expert names into transformers' stacked
    experts, rollout/weights.py), and the behaviour weights stay at 1."""
    from test_ppo_e2e import _overrides, _ppo_worker

    steps = 2
    overrides = _overrides(
        task_assets(tmp_path, ARCH), tmp_path, "replay", "actor.parallel.tp=2", "actor.router_replay=true",
        "server.return_routed_experts=true", "server.context_length=256", "rollout.temperature=0.7",
        "rollout.n_samples=2", "rollout.max_new_tokens=12", "ppo.use_decoupled_loss=true",
        "ppo.reward_norm.group_size=2", "actor.optimizer.lr=1e-3", f"trainer.total_steps={steps}")
    rows = run_gloo(_ppo_worker, 2, overrides)[0]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert [r["moe/router_disagreement"] for r in rows] == [0.0] * steps, rows
    assert all(r["sync/server_versions"] == [str(r["step"])] for r in rows), rows
    for r in rows:
        assert abs(r["train/behav_imp_weight_mean"] - 1) <= 0.02, r
