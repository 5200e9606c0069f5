"""DAPO's options (arXiv 2503.14476): dynamic sampling in the rollout executor (sync and
async, against a fake client), the soft overlong penalty and overlong filtering in the
training batch, their config checks; and a tiny sync and async PPO run with dynamic
sampling, checked from the rollout dump."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest
import torch

from areal_mcore.algo import overlong_penalty
from areal_mcore.algo.config import NormConfig, OverlongPenaltyConfig, PPOConfig
from areal_mcore.checks import FieldError
from areal_mcore.config import load_config
from areal_mcore.data.prompts import Prompt
from areal_mcore.packing import unpack
from areal_mcore.rollout.client import Completion
from areal_mcore.rollout.config import RolloutConfig
from areal_mcore.rollout.episodes import EpisodeEnv
from areal_mcore.rollout.episodes.single_turn import SingleTurn
from areal_mcore.rollout.executor import RolloutExecutor, sample
from areal_mcore.rollout.trajectory import Sample, is_mixed
from areal_mcore.trainer.batch import to_train_batch

REPO = Path(__file__).parents[1]
ALL_WRONG, ALL_RIGHT, MIXED = 0, 1, 2


class _FakeClient:
    """Completes every request at once: output [kind of the prompt, sample index]."""

    async def generate(self, input_ids, sampling, rid, group):
        j = int(rid.split("s")[1].split("-")[0])
        return Completion(rid=rid, input_ids=input_ids, output_ids=[input_ids[0], j], logprobs=[-0.5, -0.5],
                          versions=["0", "0"], finish_reason={"type": "stop"})


async def _reward(items):
    """ALL_WRONG prompts score 0, ALL_RIGHT 1, MIXED 1 on even sample indices."""
    out = []
    for item in items:
        kind, j = map(int, item.completion.split(","))
        out.append(float(kind == ALL_RIGHT or (kind == MIXED and j % 2 == 0)))
    return out


def _cfg(**cfg):
    return RolloutConfig(max_new_tokens=8, n_samples=4, dynamic_sampling=True, **cfg)


def _episode(cfg):
    return SingleTurn(cfg, EpisodeEnv(score=_reward, decode=lambda ids: f"{ids[0]},{ids[1]}"))


def _executor(bs, sync=True, **cfg):
    cfg = _cfg(**cfg)
    return RolloutExecutor(cfg, _FakeClient(), _episode(cfg), batch_size=bs, sync=sync)


async def _one_batch(ex, prompts, bs):
    ex.submit(prompts)
    try:
        return await asyncio.wait_for(ex.wait(bs), 10)  # a miscount stalls admission
    finally:
        await ex.stop()


def _prompts(kinds):
    return [Prompt(input_ids=[k, 7], solutions=("1",), source="t") for k in kinds]


def test_is_mixed_true_only_when_raw_rewards_differ():
    def group(*rewards):
        return [Sample(group=0, prompt_ids=[1], output_ids=[2], logprobs=[0.0], versions=[0], reward=r,
                       finish_reason="stop", start_version=0) for r in rewards]
    assert is_mixed(group(0.0, 1.0, 0.0)) and is_mixed(group(1.0, 0.0))
    assert not is_mixed(group(0.0, 0.0, 0.0)) and not is_mixed(group(1.0, 1.0)) and not is_mixed(group(1.0))


def test_sync_dynamic_sampling_replaces_each_rejected_group_until_the_batch_holds_only_mixed_ones():
    # Admitted while the batch is waited for, never more than it can use: groups 0-2, then
    # one new group for each rejected one (0 and 2), so nothing is left in flight and the
    # groups judged do not depend on which lands first.
    prompts = iter(_prompts([ALL_WRONG, MIXED, ALL_RIGHT, MIXED, MIXED, ALL_WRONG]))
    ex = _executor(3)
    batch = asyncio.run(_one_batch(ex, prompts, 3))
    groups = {}
    for s in batch.samples:
        groups.setdefault(s.group, []).append(s.reward)
    assert list(groups) == [1, 3, 4]  # in submission order
    assert all(0.0 < sum(r) < len(r) for r in groups.values())
    assert next(prompts).input_ids[0] == ALL_WRONG  # the sixth prompt was never drawn
    st = batch.stats
    assert st["rollout/dynamic_kept_ratio"] == 3 / 5 and st["rollout/dynamic_rounds"] == 5 / 3
    assert st["rollout/dynamic_groups"] == 3 and st["rollout/n_samples"] == 12
    # Only trained groups count as consumed/accepted; the state restores exactly.
    a = ex.admission
    assert a.consumed == a.accepted == 3 and a.dropped_uniform == 2 and a.running == a.ready == 0
    state = ex.state_dict()
    assert state == {"version": 0, "consumed": 3, "next_group": 5, "dropped_stale": 0, "dropped_uniform": 2}
    again = _executor(3)
    again.load_state_dict(state)
    assert again.state_dict() == state


def test_sync_dynamic_sampling_bound_cuts_the_batch_short_with_a_warning():
    ex = _executor(2, dynamic_sampling_max_rounds=2)
    with pytest.warns(RuntimeWarning, match=r"only 1 of 2 groups.*dynamic_sampling_max_rounds=2"):
        batch = asyncio.run(_one_batch(ex, _prompts([ALL_WRONG, ALL_RIGHT, MIXED, ALL_RIGHT, MIXED]), 2))
    assert {s.group for s in batch.samples} == {2} and batch.stats["rollout/dynamic_rounds"] == 2
    assert batch.stats["rollout/dynamic_kept_ratio"] == 1 / 4 and ex.admission.next_group == 4


def test_sample_for_evaluation_keeps_every_group():
    cfg = _cfg()
    batch = asyncio.run(sample(cfg, _FakeClient(), _episode(cfg), _prompts([ALL_WRONG, ALL_RIGHT])))
    assert len(batch.samples) == 8 and "rollout/dynamic_kept_ratio" not in batch.stats


def test_async_dynamic_sampling_dropped_groups_free_capacity_and_never_count_as_accepted():
    bs, ofp = 2, 1
    ctrl = _executor(bs, sync=False, max_head_offpolicyness=ofp, max_concurrent_rollouts=64)
    a = ctrl.admission
    kinds = [ALL_WRONG, MIXED, ALL_RIGHT] * 100  # one mixed group in three

    async def run():
        ctrl.submit(iter(_prompts(kinds)))
        out = []
        for step in range(3):
            out.append(await asyncio.wait_for(ctrl.wait(bs), 10))  # a miscount stalls admission
            # The staleness bound counts only trained-or-ready groups.
            assert a.accepted + a.running <= (ofp + a.version + 1) * bs
            ctrl.set_version(step + 1)
        await ctrl.stop()
        return out

    batches = asyncio.run(run())
    for b in batches:
        by_group = {}
        for s in b.samples:
            by_group.setdefault(s.group, []).append(s.reward)
        assert len(by_group) == bs and all(0 < sum(r) < len(r) for r in by_group.values())
        assert 0 < b.stats["rollout/dynamic_kept_ratio"] < 1
    assert a.consumed == 3 * bs and a.dropped_uniform > 0
    assert a.accepted == a.consumed + a.ready == a.consumed + len(ctrl._ready)  # dropped groups never in accepted


def test_async_dynamic_sampling_bound_hands_out_a_short_batch_with_a_warning():
    # Staleness 0: 4 groups in flight at a time, so the first 4 land before more start.
    ctrl = _executor(4, sync=False, dynamic_sampling_max_rounds=1, max_head_offpolicyness=0)
    with pytest.warns(RuntimeWarning, match="only 1 of 4 groups"):
        batch = asyncio.run(_one_batch(ctrl, iter(_prompts([ALL_WRONG, MIXED, ALL_RIGHT, ALL_RIGHT] * 10)), 4))
    assert {s.group for s in batch.samples} == {1} and batch.stats["rollout/dynamic_rounds"] == 1.0


def test_overlong_penalty_is_zero_then_linear_to_minus_factor_at_the_limit():
    lens = torch.tensor([0, 12, 13, 14, 16, 20])
    got = overlong_penalty(lens, max_new_tokens=16, buffer_len=4, penalty_factor=2.0)
    # DAPO eq. 13, written out: 0 up to L_max - L_cache = 12, then (12 - |y|) / 4, -1 past L_max.
    want = [0.0 if n <= 12 else (12 - n) / 4 if n <= 16 else -1.0 for n in lens.tolist()]
    assert got.tolist() == pytest.approx([2.0 * w for w in want])


def _sample(group, reward, n_out, finish):
    return Sample(group=group, prompt_ids=[5, 6, 7], output_ids=list(range(1, n_out + 1)),
                  logprobs=[-0.3] * n_out, versions=[0] * n_out, reward=reward, finish_reason=finish,
                  start_version=0)


def test_overlong_penalty_is_added_to_the_raw_reward_before_bias_and_scaling():
    samples = [_sample(0, 1.0, 8, "length"), _sample(0, 0.0, 6, "stop"), _sample(0, 1.0, 2, "stop")]
    ppo = PPOConfig(reward_bias=-0.5, reward_scaling=10.0,
                    overlong_penalty=OverlongPenaltyConfig(buffer_len=4, penalty_factor=1.0, max_new_tokens=8))
    _, f = unpack(to_train_batch(samples, ppo))
    adv = [float(a[m.bool()][0]) for a, m in zip(f["adv"], f["loss_mask"])]
    # No normalisation: every response token's advantage is the shaped reward.
    assert adv == pytest.approx([(1 - 1.0 - 0.5) * 10, (0 - 0.5 - 0.5) * 10, (1 - 0.5) * 10])


def test_mask_truncated_samples_removes_their_tokens_from_loss_and_adv_norm():
    samples = [_sample(0, 1.0, 8, "length"), _sample(0, 0.0, 3, "stop"), _sample(1, 1.0, 5, "stop")]
    ppo = PPOConfig(mask_truncated_samples=True, adv_norm=NormConfig(mean_level="batch", std_level="batch"))
    batch = to_train_batch(samples, ppo, pad_to_multiple_of=4)
    _, f = unpack(batch)
    assert [int(m.sum()) for m in f["loss_mask"]] == [0, 3, 5]
    assert int(batch.fields["loss_mask"].sum()) == 8  # the loss normaliser counts these
    kept = batch.fields["adv"][batch.fields["loss_mask"]]
    assert float(kept.mean()) == pytest.approx(0.0, abs=1e-6)  # normalised over kept tokens only
    off = to_train_batch(samples, PPOConfig())
    assert int(off.fields["loss_mask"].sum()) == 16  # default: truncated samples train


def test_dapo_config_keys_are_off_by_default_and_validated_naming_the_key():
    cfg = load_config(REPO / "configs" / "boba_1.5b.yaml")
    assert not cfg.rollout.dynamic_sampling and cfg.ppo.overlong_penalty is None
    assert not cfg.ppo.mask_truncated_samples
    with pytest.raises(ValueError, match=r"rollout\.dynamic_sampling_max_rounds=0 must be > 0"):
        load_config(REPO / "configs" / "boba_1.5b.yaml", ["rollout.dynamic_sampling_max_rounds=0"])
    filled = load_config(REPO / "configs" / "boba_1.5b.yaml", ["ppo.overlong_penalty.buffer_len=512"])
    assert filled.ppo.overlong_penalty.max_new_tokens == filled.rollout.max_new_tokens
    with pytest.raises(ValueError, match=r"ppo\.overlong_penalty\.max_new_tokens=9 does not match"):
        load_config(REPO / "configs" / "boba_1.5b.yaml",
                    ["ppo.overlong_penalty.buffer_len=4", "ppo.overlong_penalty.max_new_tokens=9"])
    with pytest.raises(ValueError, match=r"^ppo\.overlong_penalty\.buffer_len=100000 must be <= max_new_tokens="):
        load_config(REPO / "configs" / "boba_1.5b.yaml", ["ppo.overlong_penalty.buffer_len=100000"])
    with pytest.raises(FieldError, match="buffer_len=9 must be <= max_new_tokens=8"):
        OverlongPenaltyConfig(buffer_len=9, max_new_tokens=8)


# ---- tiny end-to-end runs ------------------------------------------------------------------


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """An untrained 1-layer model: the reward (_rewards:first_token_reward) makes about half
    of its groups of 4 mixed and half uniform, so dynamic sampling drops some and keeps
    sampling (an SFT warm-up that made the maths reward mixed cost ~30 s more)."""
    from areal_mcore.data.tiny_assets import TinyAssetsConfig, build_tiny_assets

    return build_tiny_assets(TinyAssetsConfig(out_dir=str(tmp_path_factory.mktemp("dapo")), n_train=128,
                                              n_test=4, hidden_size=32, intermediate_size=64, num_layers=1))


def _ppo_worker(rank, world, overrides):
    from areal_mcore.trainer.ppo import train

    return train(load_config(None, overrides))


def _dapo_run(assets, tmp_path, name, *extra):
    from _dist import run_gloo

    overrides = [
        f"experiment_name={name}", f"model_path={assets['model']}", f"dataset.path={assets['train']}",
        "actor.vocab_divisible_by=8", "actor.mb_spec.max_tokens_per_mb=512", "actor.optimizer.lr=1e-4",
        "server.model_path=${model_path}", "server.dtype=float32", "server.context_length=256",
        "weight_sync.dtype=float32", "weight_sync.master_address=127.0.0.1", "reward.num_workers=1",
        "rollout.max_new_tokens=16", "rollout.n_samples=4", "rollout.dynamic_sampling=true",
        "rollout.dynamic_sampling_max_rounds=12", "ppo.reward_bias=-0.5", "ppo.reward_scaling=10.0",
        "ppo.reward_norm.mean_level=group", "ppo.reward_norm.std_level=group",
        "ppo.overlong_penalty.buffer_len=4", "reward.fn=_rewards:first_token_reward",
        "trainer.batch_size=4", "trainer.total_steps=3", "trainer.dump_to_file=true",
        f"trainer.log_dir={tmp_path / 'runs'}", "trainer.progress=false", *extra]
    (rows,) = run_gloo(_ppo_worker, 1, overrides)
    return rows, tmp_path / "runs" / name


def _check_dapo_run(rows, run_dir, steps=3):
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        assert r["rollout/dynamic_rounds"] >= 1 and math.isfinite(r["train/loss"][0])
        assert r["rollout/n_samples"] == 4 * r["rollout/dynamic_groups"]
    assert min(r["rollout/dynamic_kept_ratio"] for r in rows) < 1.0  # some groups were dropped
    assert rows[-1]["rollout/dropped_uniform"] > 0
    for step, row in zip(range(1, steps + 1), rows):
        dumped = [json.loads(x) for x in (run_dir / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()]
        groups = {}
        for d in dumped:
            groups.setdefault(d["group"], []).append(d["reward"])
        assert groups and all(len(set(g)) > 1 for g in groups.values()), (step, groups)  # only mixed
        # The overlong penalty (buffer 4 of 16 tokens) the step's trained samples got.
        lens = torch.tensor([d["response_len"] for d in dumped])
        want = overlong_penalty(lens, max_new_tokens=16, buffer_len=4, penalty_factor=1.0)
        assert row["rollout/overlong_penalty_mean"] == pytest.approx(float(want.mean()))
        assert row["rollout/overlong_penalised_ratio"] == float((want < 0).float().mean())


@pytest.mark.slow
@pytest.mark.server
def test_sync_dynamic_sampling_run_trains_only_mixed_groups(assets, tmp_path):
    rows, run_dir = _dapo_run(assets, tmp_path, "dapo_sync")
    _check_dapo_run(rows, run_dir)
    # Every step is full (the bound of 12 rounds is generous: 1-3 were needed) and versions are current.
    assert all(r["rollout/dynamic_groups"] == 4 for r in rows)
    assert all(r["rollout/staleness_max"] == 0 for r in rows)


@pytest.mark.slow
@pytest.mark.server
def test_async_dynamic_sampling_run_trains_only_mixed_groups_within_staleness(assets, tmp_path):
    # This run also carries the KL to the frozen reference and the entropy bonus (issue 33),
    # whose maths tests/test_kl_entropy.py checks: here, that the loop wires them.
    rows, run_dir = _dapo_run(assets, tmp_path, "dapo_async", "trainer.mode=async",
                              "rollout.max_head_offpolicyness=1", "ppo.use_decoupled_loss=true",
                              "ppo.kl_coef=0.1", "ppo.kl_estimator=k3", "ppo.entropy_coef=0.01")
    _check_dapo_run(rows, run_dir)
    kl = [r["train/ref_kl"] for r in rows]
    assert kl[0] == 0.0 and 0.0 < kl[1] < kl[2]  # π_ref is the initial policy; θ moves away from it
    assert all(0.0 < r["train/entropy"] <= math.log(512) and r["time/reference_s"] > 0 for r in rows)
    assert all(r["rollout/staleness_max"] <= 1 for r in rows)
    assert all(r["sync/server_versions"] == [str(r["step"])] for r in rows)
