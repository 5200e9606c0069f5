"""The rollout executor against a real embedded server: groups, rewards through the reward
pool, and the staleness bound of async rollout across pause/resume and checkpoint/resume."""

from __future__ import annotations

import asyncio

import pytest
from _rollout import EOS, embedded_servers, tiny_hf_dir

from areal_mcore.data.prompts import Prompt
from areal_mcore.reward.pool import RewardPool, RewardPoolConfig
from areal_mcore.rollout.client import ClientConfig, RolloutClient
from areal_mcore.rollout.config import RolloutConfig
from areal_mcore.rollout.episodes import EpisodeEnv
from areal_mcore.rollout.episodes.single_turn import SingleTurn
from areal_mcore.rollout.executor import RolloutExecutor, sample

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
                episode = SingleTurn(cfg, EpisodeEnv(score=pool.ascore, decode=lambda ids: f"\\boxed{{{len(ids) % 3}}}"))
                return await sample(cfg, client, episode, _prompts(3))

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


def _async(cfg, client, bs):
    episode = SingleTurn(cfg, EpisodeEnv(score=_count_reward, decode=str))
    return RolloutExecutor(cfg, client, episode, batch_size=bs, sync=False)


async def _train_steps(ctrl, client, model, steps, bs, ofp, seen):
    a = ctrl.admission
    for _ in range(steps):
        batch = await ctrl.wait(bs)
        v = a.version
        assert batch.version == v and len(batch.samples) == bs * ctrl.cfg.n_samples
        for s in batch.samples:  # the acceptance check: every sample, every step
            assert v - s.start_version <= ofp, (v, s.start_version)
            assert v - s.versions[0] <= ofp, (v, s.versions)
            seen.append(v - s.start_version)
        assert a.accepted + a.running <= (ofp + v + 1) * bs
        # "train", then publish version v + 1: pause, load, resume, and only then tell the
        # executor (admission must never count against weights the servers lack).
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
            ctrl = _async(cfg, client, bs)
            ctrl.submit(iter(_prompts(400)))
            await _train_steps(ctrl, client, model, 4, bs, ofp, seen)
            state = ctrl.state_dict()
            await ctrl.stop()
            await client.abort_all()

        # A new process: new client and executor, restored from the checkpoint.
        async with RolloutClient(ClientConfig(addresses=[srv.address])) as client:
            ctrl = _async(cfg, client, bs)
            ctrl.load_state_dict(state)
            assert ctrl.admission.version == 4 and ctrl.admission.accepted == 4 * bs
            # AReaL #1388: a reset counter here would admit (ofp + 5) batches at once.
            assert ctrl.admission.capacity() == (ofp + 1) * bs
            ctrl.submit(iter(_prompts(400, start=state["next_group"])))
            await _train_steps(ctrl, client, model, 4, bs, ofp, seen)
            assert ctrl.admission.max_generating_seen <= cfg.max_concurrent_rollouts * cfg.n_samples
            await ctrl.stop()
            return ctrl

    ctrl = asyncio.run(run())
    assert len(seen) == 8 * bs * 2
    assert max(seen) == ofp  # the bound was reached, so the check above was exercised
    assert ctrl.admission.version == 8


class _Stuck:
    async def generate(self, *args, **kwargs):
        await asyncio.Event().wait()  # a request that never answers


@pytest.mark.parametrize("sync", [True, False])
def test_groups_cancelled_before_their_requests_started_give_their_slots_back(sync):
    """A sample's slot came back when its request ended; a request cancelled before it
    started never ran that code, so its slots stayed taken and a later batch on the same
    executor admitted less (or nothing)."""
    cfg = RolloutConfig(max_new_tokens=4, n_samples=4, max_concurrent_rollouts=2)

    async def run():
        episode = SingleTurn(cfg, EpisodeEnv(score=_count_reward, decode=str))
        ctrl = RolloutExecutor(cfg, _Stuck(), episode, batch_size=3, sync=sync)
        ctrl.submit(_prompts(3))
        waiting = asyncio.ensure_future(ctrl.wait(3))
        for _ in range(3):  # the groups' tasks are created, none has started its requests
            await asyncio.sleep(0)
        held = ctrl.admission.generating, ctrl.admission.running
        waiting.cancel()
        await ctrl.stop()
        return held, (ctrl.admission.generating, ctrl.admission.running)

    # 2 groups x 4 samples admitted (the request slots' bound), then all given back.
    assert asyncio.run(run()) == ((8, 2), (0, 0))


def test_the_write_your_own_episode_example_of_the_docs_runs_and_marks_its_nudge_as_context(server):
    """docs/episodes.md's example episode, executed as written, through the executor."""
    import re
    from pathlib import Path

    from areal_mcore.rollout.episodes import EpisodeEnv

    page = (Path(__file__).parents[1] / "docs" / "episodes.md").read_text()
    (code,) = [b for b in re.findall(r"```python\n(.*?)```", page, re.S) if "class AnswerTwice" in b]
    scope: dict = {}
    exec(compile(code, "docs/episodes.md", "exec"), scope)
    srv, _ = server
    cfg = RolloutConfig(max_new_tokens=12, n_samples=2, stop_token_ids=STOPS, seed=5)

    async def score(items):
        return [float(len(i.completion_ids) % 2) for i in items]

    async def run():
        async with RolloutClient(ClientConfig(addresses=[srv.address])) as client:
            env = EpisodeEnv(score=score, decode=str, encode=lambda text: [40, 41, 42])
            return await sample(cfg, client, scope["AnswerTwice"](cfg, env), _prompts(2))

    batch = asyncio.run(run())
    assert len(batch.samples) == 4
    for s in batch.samples:
        i = s.versions.index(-1)
        assert s.versions[i:i + 3] == [-1] * 3 and s.output_ids[i:i + 3] == [40, 41, 42]
        assert -1 not in s.versions[:i] + s.versions[i + 3:] and len(s.logprobs) == len(s.output_ids)
        assert s.reward == float(len(s.output_ids) % 2)
