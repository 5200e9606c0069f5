"""Tied embeddings with pipeline parallelism on gloo (the tiny model and Qwen2.5 <= 3B tie
them): PP=2 trains, exports and syncs exactly like PP=1."""

from __future__ import annotations

import pytest
import torch
from _actor_setup import VOCAB, ppo_loss, push_once, seqs, tiny_actor, train_fields
from _dist import run_gloo
from _rollout import embedded_servers, http
from _tiny_model import tiny_qwen2

from areal_mcore.packing import pack

pytestmark = pytest.mark.multirank


def _train_worker(rank, world, pp, hf_dir):
    from areal_mcore.convert.save_hf import save_hf

    actor = tiny_actor(pp=pp, cap=24, tie=True)
    s = seqs()
    logp = actor.compute_logprobs(pack(s))
    out = actor.train_batch(pack(s, train_fields(s)), ppo_loss, n_minibatches=2)
    module = actor.model.module
    # megatron's tie: the last stage's output layer is a copy that must track the embedding.
    copy = module.output_layer.weight.detach().clone() if pp > 1 and actor.groups.is_last_stage else None
    embedding = module.embedding.word_embeddings.weight.detach().clone() if actor.groups.is_first_stage else None
    save_hf(actor, hf_dir, max_shard_bytes=100_000)
    return {"loss": out["loss"], "grad_norm": out["grad_norm"], "logp": logp,
            "hf": actor.hf_state_dict(), "copy": copy, "embedding": embedding}


@pytest.fixture(scope="module")
def pp1(tmp_path_factory):
    return run_gloo(_train_worker, 1, 1, str(tmp_path_factory.mktemp("pp1")))[0]


def test_pp2_tied_embeddings_train_and_export_equal_pp1(pp1, tmp_path):
    from areal_mcore.convert.tools import load_hf_state_dict

    results = run_gloo(_train_worker, 2, 2, str(tmp_path))
    hf = {k: v for r in results for k, v in r["hf"].items()}
    assert set(hf) == set(pp1["hf"]) and "lm_head.weight" not in hf  # tied: HF stores one matrix
    for r in results:
        assert r["loss"] == pytest.approx(pp1["loss"], rel=1e-5)
        assert r["grad_norm"] == pytest.approx(pp1["grad_norm"], rel=1e-5)
        assert (r["logp"] - pp1["logp"]).abs().max() <= 1e-5
    for name, ref in pp1["hf"].items():
        rel = (hf[name] - ref).abs().max() / ref.abs().max()
        assert rel <= 1e-5, f"{name}: relative difference {rel:.2e}"
    # After the update the last stage's copy still equals the first stage's embedding.
    assert torch.equal(results[1]["copy"], results[0]["embedding"])
    saved = load_hf_state_dict(tmp_path)
    assert set(saved) == set(hf) and all(torch.equal(saved[k], hf[k]) for k in hf)


def _sync_worker(rank, world, address):
    from areal_mcore.weight_sync import weight_syncer
    from areal_mcore.weight_sync.config import WeightSyncConfig

    actor = tiny_actor(pp=2, tie=True)
    syncer = weight_syncer(WeightSyncConfig(bucket_mb=0.02, dtype="float32", master_address="127.0.0.1",
                                           timeout_s=60), actor, [address])
    push_once(syncer, 7)
    return {k: v.clone() for k, v in actor.hf_state_dict().items()}


@pytest.mark.server
def test_pp2_tied_embeddings_sync_to_a_server_bitwise(tmp_path):
    _, _, model = tiny_qwen2(21, tie=True, vocab=VOCAB)  # the server starts from other weights
    model.save_pretrained(tmp_path / "hf")
    with embedded_servers(str(tmp_path / "hf"), str(tmp_path / "logs"), n=1) as servers:
        results = run_gloo(_sync_worker, 2, servers[0].address)
        hf = {k: v for r in results for k, v in r.items()}
        assert "model.embed_tokens.weight" in hf and "lm_head.weight" not in hf
        for name, want in hf.items():
            status, rows = http(servers[0].address, "POST", "/get_weights_by_name",
                                {"name": name, "truncate_size": want.shape[0]})
            assert status == 200 and torch.equal(torch.tensor(rows, dtype=torch.float32), want), name
        assert http(servers[0].address, "GET", "/model_info")[1]["weight_version"] == "7"


def _ppo_worker(rank, world, overrides):
    from areal_mcore.config import load_config
    from areal_mcore.trainer.ppo import train

    return train(load_config(None, overrides))


@pytest.mark.slow
@pytest.mark.server
def test_tiny_ppo_run_at_pp2_with_tied_embeddings_equals_pp1(tmp_path):
    """The new user's command (`train --config configs/tiny_cpu.yaml actor.parallel.pp=2`)
    in CI size: rollouts, rewards, training, weight sync and the HF export, step for step
    the numbers of the PP=1 run (the servers sample with the same weights and seeds)."""
    from transformers import AutoModelForCausalLM

    from areal_mcore.data.tiny_assets import TinyAssetsConfig, build_tiny_assets

    assets = build_tiny_assets(TinyAssetsConfig(out_dir=str(tmp_path / "assets"), n_train=16, n_test=4,
                                                hidden_size=64, intermediate_size=128, num_layers=2))

    def overrides(name, pp):
        return [f"experiment_name={name}", f"model_path={assets['model']}", f"dataset.path={assets['train']}",
                "actor.vocab_divisible_by=8", "actor.mb_spec.max_tokens_per_mb=64", f"actor.parallel.pp={pp}",
                "actor.optimizer.lr=1e-4",
                "server.model_path=${model_path}", "server.dtype=float32", "weight_sync.dtype=float32",
                "weight_sync.master_address=127.0.0.1", "reward.num_workers=1", "trainer.batch_size=2",
                f"trainer.log_dir={tmp_path / 'runs'}", "trainer.progress=false", "trainer.total_steps=2",
                "rollout.max_new_tokens=12", "rollout.n_samples=2", "ppo.reward_norm.group_size=2",
                "server.context_length=256", "trainer.tensorboard=false"]

    (one,) = run_gloo(_ppo_worker, 1, overrides("pp1", 1))
    two = run_gloo(_ppo_worker, 2, overrides("pp2", 2))
    for ref, row in zip(one, two[0], strict=True):
        assert row["sync/server_versions"] == [str(row["step"])]
        assert row["rollout/reward_mean"] == ref["rollout/reward_mean"]
        assert row["train/loss"] == pytest.approx(ref["train/loss"], rel=1e-4)
        assert row["train/grad_norm"] == pytest.approx(ref["train/grad_norm"], rel=1e-4)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "runs" / "pp2" / "hf" / "step_2")
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "runs" / "pp1" / "hf" / "step_2")
    assert exported.config.tie_word_embeddings
    for (name, a), (_, b) in zip(exported.state_dict().items(), reference.state_dict().items(), strict=True):
        assert (a - b).abs().max() <= 1e-4 * max(b.abs().max(), 1e-6), name
