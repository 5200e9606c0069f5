"""A multi-turn episode: n samples of one prompt, each of which may call a tool.

Token in, token out: a sample is generated turn by turn from token ids. A turn ends when
the model closes a call (it writes ``call_end``, a stop token) or stops; the text the
turn wrote after its last ``call_start`` goes to the tool (``reward/tool_call.py``, run in the
reward pool's killable workers), and the observation is appended as
``obs_start + encode(observation) + obs_end``, with version -1 and logprob 0 (context: no
loss, no advantage, ``rollout/trajectory.py``). The next turn continues from the ids as
they are: nothing is decoded and re-encoded between turns, so the trainer scores exactly
the tokens the server generated. The four markers must each be one token (special tokens
of the tokenizer), so that how an observation is encoded cannot depend on its neighbours.

Limits per sample: ``max_turns`` generations (a call in the last one truncates the
sample: finish_reason ``length``) and ``rollout.max_new_tokens`` tokens over all turns,
observations included. The group is scored once at the end by ``reward.fn`` on the whole
response text.

Config::

    rollout:
      episode: areal_mcore.rollout.episodes.tool_use:ToolCalls
      episode_args: {max_turns: 3}
"""

from __future__ import annotations

import asyncio
import dataclasses

from areal_mcore.data.prompts import Prompt
from areal_mcore.reward.pool import RewardItem
from areal_mcore.reward.tool_call import CALCULATOR, ToolCall
from areal_mcore.rollout.config import RolloutConfig
from areal_mcore.rollout.episodes import EpisodeEnv, GroupClient
from areal_mcore.rollout.trajectory import Sample, versions_of


class ToolCalls:
    def __init__(self, cfg: RolloutConfig, env: EpisodeEnv | None, *, tool: str = CALCULATOR,
                 call_start: str = "<calc>", call_end: str = "</calc>", obs_start: str = "<out>",
                 obs_end: str = "</out>", max_turns: int = 3):
        if max_turns < 1:
            raise ValueError(f"max_turns={max_turns} must be at least 1")
        self.cfg, self.env, self.tool, self.max_turns = cfg, env, tool, max_turns
        self.markers = (call_start, call_end, obs_start, obs_end)
        if env is None:  # the config's check (RolloutConfig binds the arguments only)
            return
        if env.encode is None or env.tools is None:
            raise ValueError("the ToolCalls episode needs a tokenizer's encode and the reward pool's tools")
        ids = []
        for marker in self.markers:
            enc = env.encode(marker)
            if len(enc) != 1:
                raise ValueError(f"rollout.episode_args: {marker!r} is {len(enc)} tokens {enc}; each tool-call "
                                 "marker must be one token (add it to the tokenizer as a special token)")
            ids.append(enc[0])
        self.call_start_id, self.call_end_id, self.obs_start_id, self.obs_end_id = ids

    async def run(self, client: GroupClient, prompt: Prompt, version: int) -> list[Sample]:
        samples = await asyncio.gather(*[self._sample(client, prompt, j, version)
                                         for j in range(self.cfg.n_samples)])
        decode = self.env.decode
        items = [RewardItem(prompt=decode(prompt.input_ids), completion=decode(s.output_ids),
                            prompt_ids=list(prompt.input_ids), completion_ids=list(s.output_ids),
                            solutions=list(prompt.solutions), fields={**prompt.fields, "source": prompt.source})
                 for s in samples]
        for s, r in zip(samples, await self.env.score(items)):
            s.reward = float(r)
        return list(samples)

    async def _sample(self, client: GroupClient, prompt: Prompt, j: int, version: int) -> Sample:
        base = self.cfg.sampling()
        base = dataclasses.replace(base, stop_token_ids=[*base.stop_token_ids, self.call_end_id])
        budget = self.cfg.max_new_tokens
        out, logprobs, versions = [], [], []
        calls, attempts, routed, finish = 0, 0, None, "length"
        try:
            for turn in range(self.max_turns):
                sampling = dataclasses.replace(base, max_new_tokens=budget - len(out))
                c = await client.generate(list(prompt.input_ids) + out, sampling, sample=j, turn=turn, last=False)
                out += c.output_ids
                logprobs += c.logprobs
                versions += versions_of(c.versions)
                attempts += c.attempts
                # The last request's routing covers the whole trajectory (its prefill routed
                # the earlier turns and observations): what routing replay needs.
                routed = c.routed_experts
                finish = c.finish_reason["type"]
                if not (finish == "stop" and c.output_ids and c.output_ids[-1] == self.call_end_id):
                    break  # the model answered (or ran out of tokens)
                if turn == self.max_turns - 1:
                    finish = "length"  # a call it may not make: truncated
                    break
                calls += 1
                obs = await self._observe(c.output_ids)
                room = budget - len(out)
                if len(obs) >= room:  # no room to answer after it
                    finish = "length"
                    break
                out += obs
                logprobs += [0.0] * len(obs)
                versions += [-1] * len(obs)
        finally:
            client.done(j)
        return Sample(group=client.group, prompt_ids=list(prompt.input_ids), output_ids=out, logprobs=logprobs,
                      versions=versions, reward=0.0, finish_reason=finish, start_version=version,
                      failovers=attempts, routed_experts=routed, tool_calls=calls)

    async def _observe(self, turn_ids: list[int]) -> list[int]:
        """The tool's observation of the call that ends ``turn_ids``, as token ids."""
        start = max((i for i, t in enumerate(turn_ids) if t == self.call_start_id), default=-1)
        args = self.env.decode(turn_ids[start + 1:-1])
        (text,) = await self.env.tools([ToolCall(self.tool, args)])
        return [self.obs_start_id, *self.env.encode(text), self.obs_end_id]
