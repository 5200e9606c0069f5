"""Micro-batch allocator vs two published baselines on realistic RL length mixes.

(a) AReaL's "FFD": sequences sorted by length, each into the feasible bin holding the
    fewest sequences, a new bin only when none fits.
(b) verl's Karmarkar–Karp largest differencing into k = ⌈Σ/cap⌉ parts, ignoring the cap.

Both are re-implemented here from their descriptions. Lengths are prompt ~ U[100, 1024]
plus a lognormal response truncated at max_new_tokens (the long tail RL produces).
Run: ``python bench/allocator.py`` (prints a table, writes bench/results/allocator.json).
"""

from __future__ import annotations

import heapq
import json
import math
import time
from pathlib import Path

import numpy as np

from areal_mcore.packing import allocate_micro_batches

# (cap, max_new_tokens) pairs: 1.5B example (16k micro-batches, 8k responses) and the
# 7B boba run (30k micro-batches, 27k responses).
SETTINGS = [(16384, 8192), (30720, 27648)]


def rl_length_mix(rng: np.random.Generator, n: int, max_new_tokens: int, *,
                  prompt_range=(100, 1024), median_frac: float = 0.25,
                  sigma: float = 0.8) -> list[int]:
    """Prompt + response token counts; responses lognormal around median_frac * max_new."""
    prompts = rng.integers(prompt_range[0], prompt_range[1] + 1, size=n)
    responses = rng.lognormal(math.log(median_frac * max_new_tokens), sigma, size=n)
    responses = np.clip(np.rint(responses), 1, max_new_tokens).astype(np.int64)
    return (prompts + responses).tolist()


def ffd_fewest_seqs(lens: list[int], cap: int) -> list[list[int]]:
    """Baseline (a): each sequence (longest first) into the feasible bin with fewest items."""
    loads = np.zeros(len(lens), dtype=np.int64)
    counts = np.zeros(len(lens), dtype=np.int64)
    bins: list[list[int]] = []
    for i in sorted(range(len(lens)), key=lambda i: (-lens[i], i)):
        open_ = len(bins)
        fits = np.flatnonzero(loads[:open_] + lens[i] <= cap)
        if fits.size:
            b = int(fits[np.argmin(counts[fits])])
        else:
            b = open_
            bins.append([])
        bins[b].append(i)
        loads[b] += lens[i]
        counts[b] += 1
    return bins


def karmarkar_karp(lens: list[int], k: int) -> list[list[int]]:
    """Baseline (b): largest differencing into k parts; slot contents kept as a merge forest."""
    n = len(lens)
    left, right = [], []  # children of merge nodes; ids >= n are merge nodes, -1 is empty

    def merge(a, b):
        sums_a, nodes_a = a
        sums_b, nodes_b = b
        oa, ob = np.argsort(-sums_a, kind="stable"), np.argsort(sums_b, kind="stable")
        la, rb = nodes_a[oa], nodes_b[ob]
        nodes = np.where(la < 0, rb, np.where(rb < 0, la, -2))
        fresh = np.flatnonzero(nodes == -2)
        nodes[fresh] = n + len(left) + np.arange(fresh.size)
        left.extend(la[fresh].tolist())
        right.extend(rb[fresh].tolist())
        return sums_a[oa] + sums_b[ob], nodes

    def singleton(i):
        sums = np.zeros(k, dtype=np.int64)
        nodes = np.full(k, -1, dtype=np.int64)
        sums[0], nodes[0] = lens[i], i
        return sums, nodes

    heap = [(-lens[i], i, None) for i in range(n)]
    heapq.heapify(heap)
    tick = n
    while len(heap) > 1:
        _, ia, pa = heapq.heappop(heap)
        _, ib, pb = heapq.heappop(heap)
        part = merge(pa or singleton(ia), pb or singleton(ib))
        heapq.heappush(heap, (-(int(part[0].max() - part[0].min())), tick, part))
        tick += 1
    _, i_last, part = heap[0]
    nodes = part[1] if part is not None else singleton(i_last)[1]
    bins = []
    for root in nodes.tolist():
        items, stack = [], [root] if root >= 0 else []
        while stack:
            node = stack.pop()
            if node < n:
                items.append(node)
            else:
                stack += [left[node - n], right[node - n]]
        bins.append(sorted(items))
    return bins


def summarize(name: str, bins: list[list[int]], lens: list[int], cap: int, seconds: float) -> dict:
    loads = [sum(lens[i] for i in b) for b in bins]
    return {
        "method": name,
        "bins": len(bins),
        "lower_bound": math.ceil(sum(lens) / cap),
        "cap_violations": sum(load > cap for load in loads),
        "max_over_mean": max(loads) / (sum(loads) / len(loads)),
        "max_tokens": max(loads),
        "seconds": seconds,
    }


METHODS = {
    "ours": lambda lens, cap: allocate_micro_batches(lens, cap),
    "ffd_fewest_seqs(a)": ffd_fewest_seqs,
    "karmarkar_karp(b)": lambda lens, cap: karmarkar_karp(lens, math.ceil(sum(lens) / cap)),
}


RESULTS = Path(__file__).parent / "results" / "allocator.json"


def main(batch_sizes=(512, 2048, 8192), seeds=(0, 1, 2), out: Path = RESULTS) -> list[dict]:
    rows = []
    for cap, max_new in SETTINGS:
        for n in batch_sizes:
            for seed in seeds:
                lens = rl_length_mix(np.random.default_rng(seed), n, max_new)
                for name, method in METHODS.items():
                    t0 = time.perf_counter()
                    bins = method(lens, cap)
                    row = summarize(name, bins, lens, cap, time.perf_counter() - t0)
                    rows.append({"cap": cap, "max_new_tokens": max_new, "batch": n, "seed": seed, **row})
    header = f"{'cap':>6} {'batch':>5} {'seed':>4} {'method':<19} {'bins':>5} {'LB':>5} {'viol':>4} {'max/mean':>8} {'ms':>8} {'x ours':>7}"
    print(header)
    print("-" * len(header))
    for row in rows:
        ours = next(r for r in rows if r["method"] == "ours" and all(
            r[k] == row[k] for k in ("cap", "batch", "seed")))
        print(f"{row['cap']:>6} {row['batch']:>5} {row['seed']:>4} {row['method']:<19} "
              f"{row['bins']:>5} {row['lower_bound']:>5} {row['cap_violations']:>4} "
              f"{row['max_over_mean']:>8.3f} {row['seconds'] * 1e3:>8.1f} "
              f"{row['seconds'] / ours['seconds']:>7.2f}")
    ours = [r for r in rows if r["method"] == "ours"]
    ffd = [r for r in rows if r["method"].startswith("ffd")]
    print(f"\nours vs (a): fewer bins on {sum(o['bins'] < f['bins'] for o, f in zip(ours, ffd))}"
          f"/{len(ours)} batches, more on {sum(o['bins'] > f['bins'] for o, f in zip(ours, ffd))}; "
          f"ours within LB+1 on {sum(o['bins'] <= o['lower_bound'] + 1 for o in ours)}/{len(ours)}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))
    print(f"wrote {out}")
    return rows


if __name__ == "__main__":
    main()
