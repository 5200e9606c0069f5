"""The rollout client at boba's concurrency, on simulated servers (bench/rollout_fleet.py):
in-process aiohttp apps, no model, a few seconds."""

import asyncio
import itertools
import time

import pytest

from areal_mcore.config import load_config
from areal_mcore.data.prompts import Prompt
from areal_mcore.rollout.client import ClientConfig, RolloutClient
from areal_mcore.rollout.config import RolloutConfig
from areal_mcore.rollout.episodes import EpisodeEnv
from areal_mcore.rollout.episodes.single_turn import SingleTurn
from areal_mcore.rollout.executor import RolloutExecutor
from bench.rollout_fleet import EngineModel, SimFleet


async def _reward(items):
    return [0.0] * len(items)


def test_requests_beyond_the_old_1024_connection_cap_are_in_flight_at_once():
    # 72 groups x 16 samples = 1,152 requests; the client's pool used to stop at 1,024.
    rollout = RolloutConfig(max_new_tokens=1000, n_samples=16, max_concurrent_rollouts=72)
    assert rollout.connections == 1152
    # Nothing finishes during the test: responses of 1,000 tokens at a 1 s decode step.
    model = EngineModel(kv_tokens=10**7, max_running=1000, lengths=(1000,), step_s=1.0)
    with SimFleet(3, model) as fleet:
        async def run() -> int:
            client = RolloutClient(ClientConfig(addresses=fleet.addresses, max_connections=rollout.connections))
            async with client:
                episode = SingleTurn(rollout, EpisodeEnv(score=_reward, decode=lambda ids: ""))
                ctrl = RolloutExecutor(rollout, client, episode, batch_size=72, sync=False)
                ctrl.submit(Prompt(input_ids=[1, 2, 3], solutions=("1",), source=f"p{i}") for i in itertools.count())
                deadline = time.monotonic() + 60
                seen = 0
                while seen < rollout.connections and time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
                    seen = sum(len(s.running) + len(s.waiting) for s in fleet.servers)
                await ctrl.stop()
                return seen
        assert asyncio.run(run()) == 1152


def test_a_connection_cap_below_the_requests_in_flight_is_refused_by_name():
    with pytest.raises(ValueError, match=r"rollout\.max_connections=1024 is below .* 256 x 16 = 4096"):
        load_config("configs/boba_32b_ppo.yaml", ["rollout.max_concurrent_rollouts=256",
                                                  "rollout.max_connections=1024"])
    cfg = load_config("configs/boba_32b_ppo.yaml", ["rollout.max_connections=null"])
    assert cfg.rollout.connections == cfg.rollout.max_concurrent_rollouts * cfg.rollout.n_samples
