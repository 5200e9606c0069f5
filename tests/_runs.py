"""What the tests compare between two runs of the same config: their stats rows."""

from __future__ import annotations


def same_steps(rows, reference):
    """Every row equals the uninterrupted run's row of its step, bitwise."""
    by_step = {r["step"]: r for r in reference}
    for row in rows:
        ref = by_step[row["step"]]
        for key in ("rollout/reward_mean", "rollout/response_len_mean", "train/loss", "train/grad_norm"):
            assert row[key] == ref[key], (row["step"], key, row[key], ref[key])
