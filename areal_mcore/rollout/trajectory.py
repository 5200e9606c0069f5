"""What an episode returns and a batch holds: trajectories (``Sample``) and their stats."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np


@dataclass
class Sample:
    """One trajectory: the prompt's token ids and the response's, as generated.

    A multi-turn trajectory's response is every turn's tokens end to end, as generated and
    as appended (nothing is decoded and re-encoded between turns). Tokens no policy
    generated (a tool's output, text the environment appends) have version -1 and logprob
    0.0: the trainer reads them as context, as it reads the prompt (no loss, no advantage,
    no drift; ``trainer/batch.py``)."""

    group: int
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]  # weight version that produced each output token; -1: none did
    reward: float
    finish_reason: str  # stop | length | abort
    start_version: int  # trainer version when the group was admitted
    failovers: int = 0
    # MoE routing the engine returned (rollout.client.Completion.routed_experts), or None
    routed_experts: np.ndarray | None = None
    tool_calls: int | None = None  # calls a multi-turn episode ran for it; None: single-turn


@dataclass
class RolloutBatch:
    samples: list[Sample]
    version: int  # trainer version the batch is handed to
    stats: dict[str, float]


def is_mixed(group: list[Sample]) -> bool:
    """Whether a group's raw rewards (the reward function's, before bias, scaling,
    penalties and normalisation) differ: DAPO keeps only these (boba's 0/1 reward: some
    samples right and some wrong)."""
    return len({s.reward for s in group}) > 1


def _version(text: str) -> int:
    """Weight versions are step numbers; SGLang's initial 'default' is version 0."""
    return int(text) if text.lstrip("-").isdigit() else 0


def versions_of(texts: list[str]) -> list[int]:
    """Each token's weight version as an int, parsed once per distinct value (a response
    has one or two): parsing each token's came first in a profile of
    ``bench/rollout_fleet.py`` after JSON decoding, and a boba response has ~9k tokens."""
    table = {t: _version(t) for t in set(texts)}
    return [table[t] for t in texts]


def batch_stats(samples: list[Sample], version: int) -> dict[str, float]:
    """The ``rollout/*`` stats of the samples handed to the trainer at ``version``."""
    n = max(1, len(samples))
    lens = [len(s.output_ids) for s in samples] or [0]
    stale = [version - s.start_version for s in samples] or [0]
    rewards = [s.reward for s in samples] or [0.0]
    mean = sum(rewards) / n
    return {
        "rollout/n_samples": float(len(samples)),
        "rollout/response_len_mean": sum(lens) / n,
        "rollout/response_len_max": float(max(lens)),
        "rollout/prompt_len_mean": sum(len(s.prompt_ids) for s in samples) / n,
        "rollout/truncated_ratio": sum(s.finish_reason == "length" for s in samples) / n,
        "rollout/no_eos_ratio": sum(s.finish_reason != "stop" for s in samples) / n,
        "rollout/reward_mean": mean,
        "rollout/reward_std": (sum((r - mean) ** 2 for r in rewards) / n) ** 0.5,
        "rollout/accuracy": sum(r > 0 for r in rewards) / n,  # the boba reward is 1 when correct
        "rollout/generated_tokens": float(sum(lens)),
        "rollout/staleness_mean": sum(stale) / n,
        "rollout/staleness_max": float(max(stale)),
        "rollout/failovers": float(sum(s.failovers for s in samples)),
        **_tool_stats(samples),
    }


def _tool_stats(samples: list[Sample]) -> dict[str, float]:
    """A multi-turn episode's tool use: calls per sample, and the samples with any."""
    calls = [s.tool_calls for s in samples if s.tool_calls is not None]
    if not calls:
        return {}
    return {"rollout/tool_calls_mean": sum(calls) / len(calls),
            "rollout/tool_call_rate": sum(c > 0 for c in calls) / len(calls)}
