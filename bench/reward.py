"""Reward throughput and latency: in-process math-verify vs the worker pool (1 and N workers).

Realistic completions: ~2k tokens (~8 KB) of reasoning text ending in a boxed answer,
half right, half wrong. Latency percentiles on an adversarial mix (power towers, deep
nesting, huge sums, many boxes, broken braces, surrogates).
Run: ``python bench/reward.py``.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import numpy as np

from areal_mcore.reward.boba import boba_reward
from areal_mcore.reward.pool import RewardPool, RewardPoolConfig

RESULTS = Path(__file__).parent / "results" / "reward.json"
WORDS = "so we substitute the value and simplify both sides then factor the expression carefully".split()


def realistic(n: int, seed: int = 0) -> tuple[list[str], list[list[str]]]:
    rng = random.Random(seed)
    completions, solutions = [], []
    for i in range(n):
        p, q = rng.randint(1, 50), rng.randint(2, 60)
        reasoning = " ".join(rng.choice(WORDS) for _ in range(1500))
        answer = f"\\frac{{{p}}}{{{q}}}" if i % 2 == 0 else f"\\frac{{{p + 1}}}{{{q}}}"
        completions.append(f"<think>\n{reasoning}\n</think>\nThe answer is $\\boxed{{{answer}}}$.")
        solutions.append([f"\\frac{{{p}}}{{{q}}}"])
    return completions, solutions


BOXED = "\\boxed"


def hostile_completions(n: int = 200):
    """(completion, solutions, expected) for n hostile completions, cycling the kinds."""
    kinds = [
        lambda i: (f"{BOXED}{{9^{{9^{{{9 + i % 3}}}}}}}", ["1"], 0.0),
        lambda i: (f"{BOXED}{{2^{{2^{{{100 + i}}}}}}}", ["1"], 0.0),
        lambda i: (f"{BOXED}{{" + "\\frac{1}{" * 1000 + "1" + "}" * 1000 + "}", ["1"], 0.0),
        lambda i: ("\\frac{1}{" * 1000 + "1" + "}" * 1000, ["1"], 0.0),
        lambda i: (f"{BOXED}{{" + "+".join(["1"] * 70_000) + "}", ["70000"], 0.0),
        lambda i: ("1+" * 100_000 + "1", ["1"], 0.0),
        lambda i: (f"{BOXED}{{1}}" * 5000, ["1"], 1.0),
        lambda i: (f"{BOXED}{{" * 50 + "1", ["1"], 0.0),
        lambda i: (f"{BOXED}{{{{{{{{}}", ["1"], 0.0),
        lambda i: (f"{BOXED}{{{10 ** 5 + i}!}}", ["1"], 0.0),
        lambda i: (f"{BOXED}{{(10^{{6}})!}}", ["1"], 0.0),
        lambda i: (f"{BOXED}{{\udcff\ud800}}", ["1"], 0.0),
        lambda i: ("caf\udce9 " * 1000 + f"{BOXED}{{\udcfe}}", ["1"], 0.0),
    ]
    return [kinds[i % len(kinds)](i) for i in range(n)]


def adversarial(n: int) -> tuple[list[str], list[list[str]]]:
    items = hostile_completions(n)
    return [c for c, _, _ in items], [s for _, s, _ in items]


def main(n: int = 400, workers: int = 2, out: Path = RESULTS) -> dict:
    completions, solutions = realistic(n)
    boba_reward(completions[0], solutions[0])  # warm math-verify's caches, as the pool does
    t0 = time.perf_counter()
    for c, s in zip(completions, solutions, strict=True):
        boba_reward(c, s)
    in_process = n / (time.perf_counter() - t0)
    row = {"items": n, "in_process_per_s": in_process}
    for k in sorted({1, workers}):
        with RewardPool(RewardPoolConfig(num_workers=k, timeout_s=5.0)) as pool:
            pool.score(completions[:k], solutions[:k])  # workers started and warm
            t0 = time.perf_counter()
            pool.score(completions, solutions)
            row[f"pool_{k}_per_s"] = n / (time.perf_counter() - t0)
    hostile_c, hostile_s = adversarial(200)
    with RewardPool(RewardPoolConfig(num_workers=workers, timeout_s=5.0)) as pool:
        pool.score(hostile_c[:1], hostile_s[:1])
        pool.latencies.clear()
        pool.score(hostile_c, hostile_s)
        lat = np.array(pool.latencies)
        row.update(adversarial_p50_s=float(np.percentile(lat, 50)), adversarial_p99_s=float(np.percentile(lat, 99)),
                   adversarial_max_s=float(lat.max()), adversarial_timeouts=pool.timeouts)
    print(f"verifies/s  in-process {in_process:.1f}  " + "  ".join(
        f"pool x{k} {row[f'pool_{k}_per_s']:.1f} ({row[f'pool_{k}_per_s'] / in_process:.2f}x)" for k in sorted({1, workers})))
    print(f"adversarial latency p50 {row['adversarial_p50_s'] * 1e3:.0f} ms, p99 {row['adversarial_p99_s'] * 1e3:.0f} ms, "
          f"max {row['adversarial_max_s'] * 1e3:.0f} ms, timeouts {row['adversarial_timeouts']}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(row, indent=1))
    return row


if __name__ == "__main__":
    main()
