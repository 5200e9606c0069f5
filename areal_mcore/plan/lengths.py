"""Response lengths as the rollout servers see them: a documented default for boba, or
the lengths of a run's own rollout dump (``trainer.dump_to_file``: ``rollouts/step_N.jsonl``).

The planner sizes ``rollout.max_concurrent_rollouts`` from them (``plan/concurrency.py``),
and ``bench/rollout_fleet.py`` draws its simulated responses from the same default.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from statistics import NormalDist

# The seed's boba runs (R1-Distill on AReaL-boba-106k at max_new_tokens 27,648): responses
# of ~7k tokens at the median, a long tail, fewer than 5 % reaching the limit. A lognormal
# of median 7,000 and sigma 0.75 has those: mean ~9.1k, 3.4 % beyond 27,648.
BOBA_MEDIAN, BOBA_SIGMA = 7000.0, 0.75


@dataclass(frozen=True)
class Lengths:
    """Response lengths (tokens, each capped at the run's max_new_tokens) and their source."""

    tokens: tuple[int, ...]
    source: str

    def moment(self, k: int) -> float:
        return sum(float(t) ** k for t in self.tokens) / len(self.tokens)

    @property
    def mean(self) -> float:
        return self.moment(1)

    def truncated(self, max_new_tokens: int) -> float:
        """The share of responses that reach the limit."""
        return sum(t >= max_new_tokens for t in self.tokens) / len(self.tokens)


def boba_lengths(max_new_tokens: int, n: int = 4096) -> Lengths:
    """``n`` evenly spaced quantiles of the boba default (deterministic, no sampling)."""
    dist = NormalDist()
    tokens = tuple(min(max_new_tokens, max(1, round(BOBA_MEDIAN * math.exp(BOBA_SIGMA * dist.inv_cdf((i + 0.5) / n)))))
                   for i in range(n))
    return Lengths(tokens, f"boba default (lognormal, median {BOBA_MEDIAN:.0f}, sigma {BOBA_SIGMA})")


def dump_lengths(path: str | Path, max_new_tokens: int) -> Lengths:
    """The ``response_len`` of every line of a rollout dump file, or of every ``*.jsonl``
    file of a dump directory (``<run>/rollouts``)."""
    p = Path(path)
    files = sorted(p.glob("*.jsonl")) if p.is_dir() else [p]
    if not files or not all(f.is_file() for f in files):
        raise FileNotFoundError(f"plan.lengths={str(path)!r}: no rollout dump there (a step_N.jsonl file "
                                "or a run's rollouts/ directory, written with trainer.dump_to_file=true)")
    tokens = []
    for f in files:
        for n, line in enumerate(f.read_text().splitlines(), 1):
            if line.strip():
                try:
                    tokens.append(min(max_new_tokens, int(json.loads(line)["response_len"])))
                except (ValueError, KeyError, TypeError) as e:
                    raise ValueError(f"{f}:{n}: not a rollout dump line ({type(e).__name__}: {e})") from None
    if not tokens:
        raise ValueError(f"plan.lengths={str(path)!r}: the dump holds no samples")
    return Lengths(tuple(tokens), f"{len(tokens)} responses of {path}")
