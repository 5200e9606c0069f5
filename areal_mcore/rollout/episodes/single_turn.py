"""boba's episode: n single-turn samples of one prompt, scored together by ``reward.fn``."""

from __future__ import annotations

import asyncio

from areal_mcore.data.prompts import Prompt
from areal_mcore.reward.pool import RewardItem
from areal_mcore.rollout.config import RolloutConfig
from areal_mcore.rollout.episodes import EpisodeEnv, GroupClient
from areal_mcore.rollout.trajectory import Sample, versions_of


class SingleTurn:
    def __init__(self, cfg: RolloutConfig, env: EpisodeEnv):
        self.cfg, self.env = cfg, env

    async def run(self, client: GroupClient, prompt: Prompt, version: int) -> list[Sample]:
        sampling = self.cfg.sampling()
        comps = await asyncio.gather(*[client.generate(prompt.input_ids, sampling, sample=j)
                                       for j in range(self.cfg.n_samples)])
        decode = self.env.decode
        text = decode(prompt.input_ids)
        items = [RewardItem(prompt=text, completion=decode(c.output_ids), prompt_ids=list(prompt.input_ids),
                            completion_ids=list(c.output_ids), solutions=list(prompt.solutions),
                            fields={**prompt.fields, "source": prompt.source}) for c in comps]
        rewards = await self.env.score(items)
        return [Sample(group=client.group, prompt_ids=list(prompt.input_ids), output_ids=c.output_ids,
                       logprobs=c.logprobs, versions=versions_of(c.versions), reward=float(r),
                       finish_reason=c.finish_reason["type"], start_version=version, failovers=c.attempts,
                       routed_experts=c.routed_experts)
                for c, r in zip(comps, rewards)]
