"""The actor scores tokens at ``rollout.temperature``, as the rollout server sampled them:
at T = 0.7 the recomputed proximal logprobs equal the embedded server's rollout logprobs
of the same weights (fp32), so the behaviour weights are 1."""

from __future__ import annotations

import math

import pytest
import torch
from _dist import run_gloo
from _rollout import embedded_servers, http, tiny_hf_dir

pytestmark = pytest.mark.server


def _server_samples(model_dir, log_dir, temperature, n=4):
    prompts = [[5, 6, 9, 8], [11, 3, 40], [100, 2, 3, 4, 5], [17]]
    out = []
    with embedded_servers(model_dir, log_dir) as servers:
        for i, prompt in enumerate(prompts[:n]):
            status, body = http(servers[0].address, "POST", "/generate", {
                "input_ids": prompt, "return_logprob": True,
                "sampling_params": {"max_new_tokens": 12, "temperature": temperature, "ignore_eos": True,
                                    "sampling_seed": i}})
            assert status == 200, body
            out.append((prompt, body["output_ids"], [lp for lp, _, _ in body["meta_info"]["output_token_logprobs"]]))
    return out


def _actor_logprobs(rank, world, model_dir, samples, temperatures):
    from transformers import AutoConfig

    from areal_mcore.actor.config import ActorConfig, MicroBatchSpec, OptimizerConfig
    from areal_mcore.actor.megatron_actor import MegatronActor
    from areal_mcore.convert.hf_files import load_hf_state_dict
    from areal_mcore.packing import pack

    cfg = ActorConfig(mb_spec=MicroBatchSpec(max_tokens_per_mb=256), optimizer=OptimizerConfig(lr=1e-4),
                      vocab_divisible_by=8)
    actor = MegatronActor(cfg, AutoConfig.from_pretrained(model_dir))
    actor.load_hf_state_dict(load_hf_state_dict(model_dir))
    batch = pack([torch.tensor(p + o) for p, o, _ in samples])
    out = {}
    for t in temperatures:
        logp = batch.split(actor.compute_logprobs(batch, temperature=t))
        out[t] = [lp[len(p):] for lp, (p, _, _) in zip(logp, samples)]
    return out


def test_actor_logprobs_at_the_rollout_temperature_equal_the_servers_in_fp32(tmp_path):
    model_dir = tiny_hf_dir(str(tmp_path), seed=3)
    samples = _server_samples(model_dir, str(tmp_path / "logs"), temperature=0.7)
    got = run_gloo(_actor_logprobs, 1, model_dir, samples, (0.7, 1.0))[0]
    server = torch.cat([torch.tensor(lp) for _, _, lp in samples])
    at_07, at_1 = torch.cat(got[0.7]), torch.cat(got[1.0])
    assert (at_07 - server).abs().max() <= 1e-5
    # what the actor computed before it took the temperature: the weights would be off
    assert (at_1 - server).abs().max() > 1e-2


@pytest.mark.slow
def test_a_ppo_step_at_temperature_07_has_behaviour_weights_of_one(tmp_path):
    from test_ppo_e2e import _overrides, _ppo_worker

    from areal_mcore.data.tiny_assets import TinyAssetsConfig, build_tiny_assets

    assets = build_tiny_assets(TinyAssetsConfig(out_dir=str(tmp_path / "assets"), n_train=16, n_test=4,
                                                hidden_size=32, intermediate_size=64, num_layers=1))
    overrides = _overrides(assets, tmp_path, "t07", "actor.optimizer.lr=1e-4", "rollout.max_new_tokens=12",
                           "rollout.n_samples=2", "rollout.temperature=0.7", "server.context_length=256",
                           "trainer.total_steps=1", "ppo.use_decoupled_loss=true", "ppo.behav_imp_weight_cap=5.0",
                           "ppo.reward_bias=-0.5", "ppo.reward_scaling=10.0")
    (rows,) = run_gloo(_ppo_worker, 1, overrides)
    (row,) = rows
    # sync mode: the proximal policy sampled the batch, at the same temperature
    assert row["train/behav_imp_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    assert row["train/behav_imp_weight_max"] == pytest.approx(1.0, abs=1e-5)
    assert row["train/behav_dropped_ratio"] == 0.0
    # one minibatch: θ is the proximal policy, so the training pass (same temperature)
    # reproduces the recomputed logprobs
    assert abs(row["train/approx_kl"]) <= 1e-6 and row["train/clip_ratio"] == 0.0
    assert math.isfinite(row["train/loss"][0])
