"""A CI-sized boba PPO run: 2 gloo ranks (DP=2), one embedded server, weight sync."""

from __future__ import annotations

import math

import pytest
from _dist import run_gloo

from areal_mcore.config import load_config
from areal_mcore.data.tiny_assets import TinyAssetsConfig, build_tiny_assets


def _ppo_worker(rank, world, overrides):
    from areal_mcore.trainer.ppo import train

    return train(load_config(None, overrides))


@pytest.mark.slow
def test_two_rank_ppo_run_computes_rewards_trains_and_syncs_every_step(tmp_path):
    assets = build_tiny_assets(TinyAssetsConfig(out_dir=str(tmp_path / "assets"), n_train=64, n_test=8,
                                                hidden_size=64, intermediate_size=128, num_layers=2))
    steps = 3
    overrides = [
        "experiment_name=e2e", f"model_path={assets['model']}",
        "actor.mb_spec.max_tokens_per_mb=512", "actor.optimizer.lr=1e-4", "actor.vocab_divisible_by=8",
        f"dataset.path={assets['train']}",
        "rollout.max_new_tokens=16", "rollout.n_samples=4",
        "server.model_path=${model_path}", "server.dtype=float32", "server.context_length=512",
        "weight_sync.dtype=float32", "weight_sync.master_address=127.0.0.1",
        "reward.num_workers=1",
        f"trainer.total_steps={steps}", "trainer.batch_size=2", f"trainer.log_dir={tmp_path / 'runs'}",
        "ppo.reward_bias=-0.5", "ppo.reward_scaling=10.0",
        "ppo.reward_norm.mean_level=group", "ppo.reward_norm.std_level=group", "ppo.reward_norm.group_size=4",
    ]
    history = run_gloo(_ppo_worker, 2, overrides)
    rank0, rank1 = history
    assert [r["step"] for r in rank0] == list(range(1, steps + 1))
    for row in rank0:
        assert row["rollout/n_samples"] == 8  # 2 prompts x 4 samples, rewards computed for each
        assert 0.0 <= row["rollout/reward_mean"] <= 1.0
        assert row["sync/server_versions"] == [str(row["step"])]  # the server serves step k
        assert all(math.isfinite(x) for x in row["train/loss"] + row["train/grad_norm"])
        assert row["sync/bytes"] > 0
    # Both DP ranks report the same global loss (an exact token mean over the two shares).
    assert [r["train/loss"] for r in rank0] == [r["train/loss"] for r in rank1]
    assert (tmp_path / "runs" / "e2e" / "stats.jsonl").read_text().count("\n") == steps
