"""Rollout controller against a real embedded server: groups, rewards through the reward
pool, and the staleness bound of async rollout across pause/resume and checkpoint/resume."""

from __future__ import annotations

import asyncio

import pytest
from _rollout import EOS, embedded_servers, tiny_hf_dir

from areal_mcore.data.prompts import Prompt
from areal_mcore.reward.pool import RewardPool, RewardPoolConfig
from areal_mcore.rollout.client import ClientConfig, RolloutClient
from areal_mcore.rollout.controller import RolloutConfig, RolloutController

pytestmark = pytest.mark.server

# ~4 % of tokens stop a sample: lengths vary, so groups finish out of submission order.
STOPS = list(range(0, 250, 25))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("ctrl")
    model = tiny_hf_dir(str(root), seed=6)
    with embedded_servers(model, str(root / "logs"), max_running_requests=128) as s:
        yield s[0], model


def _prompts(n, start=0):
    return [Prompt(input_ids=[11 + (i % 90), 12 + (i % 70), 13], solutions=("1",), source="t")
            for i in range(start, start + n)]


async def _count_reward(items):
    return [float(len(i.completion) % 2) for i in items]


def test_sync_batch_has_groups_rewards_and_stats_through_the_reward_pool(server):
    srv, _ = server
    cfg = RolloutConfig(max_new_tokens=24, n_samples=4, stop_token_ids=STOPS, seed=3)

    async def run():
        async with RolloutClient(ClientConfig(addresses=[srv.address])) as client:
            with RewardPool(RewardPoolConfig(num_workers=1, timeout_s=20)) as pool:
                # The completion "is" \boxed{len mod 3}: reward 1 exactly when that is 1.
                ctrl = RolloutController(cfg, client, pool.ascore,
                                         decode=lambda ids: f"\\boxed{{{len(ids) % 3}}}")
                return await ctrl.rollout_batch(_prompts(3))

    batch = asyncio.run(run())
    assert len(batch.samples) == 12
    assert [s.group for s in batch.samples] == [0] * 4 + [1] * 4 + [2] * 4
    for s in batch.samples:
        assert s.reward == float(len(s.output_ids) % 3 == 1)
        assert len(s.output_ids) == len(s.logprobs) == len(s.versions) and s.versions[0] == 0
        assert (s.finish_reason == "stop") == (s.output_ids[-1] in [*STOPS, EOS])
    st = batch.stats
    assert st["rollout/n_samples"] == 12
    assert st["rollout/reward_mean"] == sum(s.reward for s in batch.samples) / 12
    assert st["rollout/truncated_ratio"] == sum(s.finish_reason == "length" and len(s.output_ids) == 24
                                                for s in batch.samples) / 12
    # Same seed, same batch: per-sample seeds make rollout reproducible.
    again = asyncio.run(run())
    assert [s.output_ids for s in again.samples] == [s.output_ids for s in batch.samples]


async def _train_steps(ctrl, client, model, steps, bs, ofp, seen):
    for _ in range(steps):
        batch = await ctrl.prepare_batch(bs)
        v = ctrl.version
        assert batch.version == v and len(batch.samples) == bs * ctrl.cfg.n_samples
        for s in batch.samples:  # the acceptance check: every sample, every step
            assert v - s.start_version <= ofp, (v, s.start_version)
            assert v - s.versions[0] <= ofp, (v, s.versions)
            seen.append(v - s.start_version)
        assert ctrl.accepted + ctrl.running <= (ofp + v + 1) * bs
        # "train", then publish version v + 1: pause, load, resume, and only then tell the
        # controller (admission must never count against weights the servers lack).
        await ctrl.pause()
        await client.fleet.all("POST", "/update_weights_from_disk",
                               {"model_path": model, "weight_version": str(v + 1)})
        await ctrl.resume()
        ctrl.set_version(v + 1)


def test_async_rollout_never_exceeds_max_head_offpolicyness_across_checkpoint_resume(server):
    srv, model = server
    bs, ofp = 4, 1
    cfg = RolloutConfig(max_new_tokens=48, n_samples=2, stop_token_ids=STOPS,
                        max_concurrent_rollouts=12, max_head_offpolicyness=ofp)
    seen: list[int] = []

    async def run():
        async with RolloutClient(ClientConfig(addresses=[srv.address])) as client:
            ctrl = RolloutController(cfg, client, _count_reward, decode=str)
            ctrl.start(iter(_prompts(400)), bs)
            await _train_steps(ctrl, client, model, 4, bs, ofp, seen)
            state = ctrl.state_dict()
            await ctrl.stop()
            await client.abort_all()

        # A new process: new client and controller, restored from the checkpoint.
        async with RolloutClient(ClientConfig(addresses=[srv.address])) as client:
            ctrl = RolloutController(cfg, client, _count_reward, decode=str)
            ctrl.load_state_dict(state)
            assert ctrl.version == 4 and ctrl.accepted == 4 * bs
            # AReaL #1388: a reset counter here would admit (ofp + 5) batches at once.
            assert ctrl.capacity(bs) == (ofp + 1) * bs
            ctrl.start(iter(_prompts(400, start=state["next_group"])), bs)
            await _train_steps(ctrl, client, model, 4, bs, ofp, seen)
            assert ctrl.max_generating_seen <= cfg.max_concurrent_rollouts * cfg.n_samples
            await ctrl.stop()
            return ctrl

    ctrl = asyncio.run(run())
    assert len(seen) == 8 * bs * 2
    assert max(seen) == ofp  # the bound was reached, so the check above was exercised
    assert ctrl.version == 8


class _Stuck:
    async def generate(self, *args, **kwargs):
        await asyncio.Event().wait()  # a request that never answers


async def _cancelled_at_admission(start, stop, steps):
    """Request slots held just after two groups were admitted (``steps`` turns of the
    event loop: their tasks created, none started yet), and after the batch was cancelled
    there."""
    cfg = RolloutConfig(max_new_tokens=4, n_samples=4, max_concurrent_rollouts=2)
    ctrl = RolloutController(cfg, _Stuck(), _count_reward, decode=str)
    handle = start(ctrl)
    for _ in range(steps):
        await asyncio.sleep(0)
    held = ctrl.generating
    await stop(ctrl, handle)
    return held, ctrl.generating


def test_groups_cancelled_before_their_requests_started_give_their_slots_back():
    """A sample's slot came back when its request ended; a request cancelled before it
    started never ran that code, so its slots stayed taken and a later batch on the same
    controller admitted less (or nothing)."""
    async def cancel(ctrl, task):
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    # Sync: the batch's task, then its groups' (whose sample requests are created, not run).
    sync = asyncio.run(_cancelled_at_admission(lambda c: asyncio.ensure_future(c.rollout_batch(_prompts(3))),
                                               cancel, steps=2))
    # Async: the admission task (the groups' own tasks are created, not run).
    async_ = asyncio.run(_cancelled_at_admission(lambda c: c.start(iter(_prompts(3)), 2),
                                                 lambda c, _: c.stop(), steps=1))
    assert sync == async_ == (8, 0)  # 2 groups x 4 samples admitted, then all given back
