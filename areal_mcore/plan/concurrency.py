"""``rollout.max_concurrent_rollouts`` from expected response lengths and the servers' KV pool.

Sizing for the worst case (every sequence in flight at the full length at once) leaves
most of the pool idle: boba's responses are ~9k tokens on average, and the engine admits
requests by KV availability itself (SGLang queues them and retracts running ones when
the pool runs out). A server's KV holds, at a random moment, one footprint per sequence
slot; a slot runs responses back to back, so it is found on a response with a probability
proportional to its length L, at a uniform point of it:

    F = prompt + U x L,  L length-biased, U ~ U(0, 1)
    E[F] = prompt + E[L^2] / (2 E[L]),  E[F^2] = prompt^2 + prompt E[L^2] / E[L] + E[L^3] / (3 E[L])

``b`` slots fit when ``b E[F] + z sqrt(b) sd(F)`` stays within the pool less
``plan.kv_headroom`` (kept for the retraction the engine does when the sum spikes above
it: a retracted request waits and is recomputed, lost work rather than a failure).

The staleness bound itself is the executor's admission's and stays exact (``max_head_offpolicyness``);
the plan reports the staleness the sizing implies on average (Little's law: groups in
flight / groups a step consumes, with the capacity rule's cap of (eta + 1) batches).
"""

from __future__ import annotations

import math

from areal_mcore.plan.lengths import Lengths

Z = 2.0  # the pool is exceeded ~2 % of the time (one-sided normal tail), before headroom


def footprint(lengths: Lengths, prompt_tokens: int) -> tuple[float, float]:
    """Mean and standard deviation of one busy slot's KV tokens (see the module docstring)."""
    m1, m2, m3 = lengths.moment(1), lengths.moment(2), lengths.moment(3)
    mean = prompt_tokens + m2 / (2 * m1)
    square = prompt_tokens ** 2 + prompt_tokens * m2 / m1 + m3 / (3 * m1)
    return mean, math.sqrt(max(0.0, square - mean ** 2))


def sequences_per_server(lengths: Lengths, prompt_tokens: int, kv_tokens: int, headroom: float) -> int:
    """The most sequences one server keeps running without its pool running out (see above)."""
    mean, sd = footprint(lengths, prompt_tokens)
    budget = (1 - headroom) * kv_tokens
    x = (-Z * sd + math.sqrt((Z * sd) ** 2 + 4 * mean * budget)) / (2 * mean)  # sqrt(b)
    return max(0, math.floor(x * x))


def concurrency(*, lengths: Lengths, prompt_tokens: int, kv_tokens: int, headroom: float, n_servers: int,
                n_samples: int, max_running_requests: int, configured_groups: int, batch_size: int | None,
                max_head_offpolicyness: int) -> dict:
    """The expected-length sizing of ``max_concurrent_rollouts`` and what the configured value
    implies: sequences per server (expected, and by the KV pool), staleness."""
    kv_fit = sequences_per_server(lengths, prompt_tokens, kv_tokens, headroom)
    # Beyond server.max_running_requests a server queues requests. A group's samples go to
    # one server (its prompt's prefix cache) while slots free up one sample at a time, so
    # servers differ by up to a group: leave one group of slack above the per-server figure
    # (bench/rollout_fleet.py: 7B at K=16 ran 82 % full without it).
    per_server = min(kv_fit, max_running_requests - n_samples)
    groups = per_server * n_servers // n_samples
    # Async mode: the capacity rule admits no more than (eta + 1) batches ahead of the trainer.
    effective = configured_groups if batch_size is None else min(configured_groups,
                                                                 (max_head_offpolicyness + 1) * batch_size)
    return {
        "lengths": lengths.source, "mean_length": lengths.mean, "slot_kv_tokens": footprint(lengths, prompt_tokens)[0],
        "sequences_fit_expected": kv_fit, "max_running_requests": max_running_requests,
        "recommended_groups": groups,
        "occupancy_per_server": effective * n_samples / n_servers,
        "expected_staleness": None if batch_size is None else effective / batch_size,
        "staleness_bound": max_head_offpolicyness,
        "fits_expected": math.ceil(effective * n_samples / n_servers) <= kv_fit,
    }
