"""The episode seam: what one prompt turns into. The one thing a new task replaces.

An episode is an object with ``async run(client, prompt, version) -> list[Sample]``: it
samples through ``client`` (a ``GroupClient``: one group's view of the rollout client),
scores, and returns the group's trajectories (``rollout/trajectory.py: Sample``), which are
trained on as one group (group-normalised rewards, dynamic sampling's judgement). The
config names a factory by dotted path, ``rollout.episode: package.module:name``, called
once per executor as ``factory(rollout_cfg, env, **rollout.episode_args)``; a class is
such a factory. ``env`` (``EpisodeEnv``) holds what an episode may use besides the client:
the reward function, the tokenizer's two directions and the tools. boba's group of n
single-turn samples is ``episodes/single_turn.py: SingleTurn``; a multi-turn episode that calls a
calculator is ``episodes/tool_use.py: ToolCalls``.

The executor (``rollout/executor.py``) knows the episode and nothing of what it does: it
admits groups, runs ``run`` and hands out the landed groups. Modelled on AReaL's
``RolloutWorkflow.arun_episode`` (``areal/api/workflow_api.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from areal_mcore.dotted import import_dotted
from areal_mcore.rollout.config import DEFAULT_EPISODE, RolloutConfig
from areal_mcore.rollout.protocol import SamplingParams

if TYPE_CHECKING:
    from areal_mcore.data.prompts import Prompt
    from areal_mcore.reward.pool import RewardItem
    from areal_mcore.reward.tool_call import ToolCall
    from areal_mcore.rollout.client import Completion, RolloutClient
    from areal_mcore.rollout.trajectory import Sample

RewardFn = Callable[["list[RewardItem]"], Awaitable[list[float]]]  # e.g. RewardPool.ascore
ToolFn = Callable[["list[ToolCall]"], Awaitable[list[str]]]  # e.g. RewardPool.arun_tools


@dataclass(frozen=True)
class EpisodeEnv:
    """What an episode may use besides the rollout client."""

    score: RewardFn  # reward.fn over a list of items, in the reward pool's workers
    decode: Callable[[list[int]], str]
    encode: Callable[[str], list[int]] | None = None  # None where the caller has no tokenizer
    tools: ToolFn | None = None  # tool calls, in the reward pool's killable workers


class Episode(Protocol):
    async def run(self, client: GroupClient, prompt: Prompt, version: int) -> list[Sample]: ...


class GroupClient:
    """One group's view of the rollout client: each sample's seed and request id come from
    (run seed, group, sample, turn), and each sample's request slot (``rollout/admission.py``)
    goes back when the sample says it is done."""

    def __init__(self, client: RolloutClient, *, group: int, seed: int, nonce: str,
                 free: Callable[[int], None]):
        self.group = group  # this group's id (the Sample.group of what the episode returns)
        self._client, self._seed, self._nonce, self._free = client, seed, nonce, free

    def seed(self, sample: int, turn: int = 0) -> int:
        """The sampling seed of ``sample``'s ``turn``: a failed-over request is redrawn the
        same way, and a rerun draws the same batch."""
        base = (self._seed * 1_000_003 + self.group) * 1009 + sample
        return base if turn == 0 else (base * 1_000_033 + turn) % (1 << 62)  # engines take 64-bit seeds

    async def generate(self, input_ids: list[int], sampling: SamplingParams, *, sample: int, turn: int = 0,
                       last: bool = True) -> Completion:
        """One completion of ``input_ids`` for ``sample``'s ``turn`` (``sampling`` with this
        turn's seed). ``last``: the sample generates nothing more after this call, so its
        request slot is given back when the call ends (a multi-turn episode passes
        ``last=False`` and calls ``done(sample)`` when it is)."""
        rid = f"g{self.group}s{sample}" + (f"t{turn}" if turn else "") + f"-{self._nonce}"
        try:
            return await self._client.generate(
                input_ids, dataclasses.replace(sampling, sampling_seed=self.seed(sample, turn)),
                rid=rid, group=f"g{self.group}-{self._nonce}")
        finally:
            if last:
                self._free(1)

    def done(self, sample: int) -> None:
        """``sample`` generates nothing more: its request slot goes back."""
        self._free(1)


def make_episode(cfg: RolloutConfig, env: EpisodeEnv) -> Episode:
    """The episode ``cfg.episode`` names (checked when the config loaded), for ``cfg``."""
    return import_dotted(cfg.episode, DEFAULT_EPISODE)(cfg, env, **cfg.episode_args)
