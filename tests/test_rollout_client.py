"""Client failover against real embedded servers: kill -9 one during a batch."""

from __future__ import annotations

import asyncio
from collections import Counter

from _rollout import embedded_servers, tiny_hf_dir

from areal_mcore.rollout.client import ClientConfig, RolloutClient
from areal_mcore.rollout.protocol import SamplingParams


def test_kill_9_one_of_two_servers_mid_batch_loses_and_duplicates_nothing(tmp_path):
    model = tiny_hf_dir(str(tmp_path), seed=4)
    prompts = [[10 + i % 50, 20 + i % 37, 30 + i % 11] for i in range(64)]
    new_tokens = 40

    async def run(servers):
        cfg = ClientConfig(addresses=[s.address for s in servers], retry_delay_s=0.05)
        async with RolloutClient(cfg) as client:
            done: list = []

            async def one(i, j):
                c = await client.generate(prompts[i], SamplingParams(
                    max_new_tokens=new_tokens, ignore_eos=True, sampling_seed=i * 4 + j),
                    rid=f"p{i}-s{j}")
                done.append(c)
                return c

            tasks = [asyncio.ensure_future(one(i, j)) for i in range(64) for j in range(4)]
            while len(done) < 32:  # kill once the batch is well under way
                await asyncio.sleep(0.01)
            in_flight_on_victim = client.servers[0].in_flight
            servers[0].kill()
            out = await asyncio.gather(*tasks)
            return out, in_flight_on_victim, [s.healthy for s in client.servers]

    with embedded_servers(model, str(tmp_path / "logs"), n=2) as servers:
        out, in_flight_on_victim, healthy = asyncio.run(run(servers))
        assert servers[1].proc.poll() is None
    assert len(out) == 256
    rids = Counter(c.rid for c in out)
    assert len(rids) == 256 and set(rids.values()) == {1}
    assert {c.rid for c in out} == {f"p{i}-s{j}" for i in range(64) for j in range(4)}
    assert all(len(c.output_ids) == new_tokens == len(c.logprobs) for c in out)
    assert all(c.finish_reason["type"] == "length" for c in out)
    assert in_flight_on_victim > 0 and sum(c.attempts for c in out) >= in_flight_on_victim
    assert healthy == [False, True]
