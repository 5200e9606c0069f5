"""Micro-batch allocator: token-budget bin packing with as few, and as even, bins as possible.

A PPO step runs one forward/backward per micro-batch, so fewer micro-batches means less
per-micro-batch overhead and even ones mean no straggler. The count starts from the lower
bound max(⌈Σ/cap⌉, min_mbs), rounded up to ``divisor``. ``_pack_dense`` fills one bin at
a time as close to the cap as a subset-sum search allows, which on RL length mixes lands
on ⌈Σ/cap⌉ or one more (first-fit decreasing variants leave a few hundred tokens spare
in many bins and need several more). When more bins are wanted (min_mbs, divisor, DP
agreement) they come from LPT or from splitting. A local search then evens out the
loads, never exceeding the cap.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

from areal_mcore import collectives


def allocate_micro_batches(
    seqlens: Sequence[int],
    max_tokens_per_mb: int,
    min_mbs: int = 1,
    divisor: int = 1,
) -> list[list[int]]:
    """Splits sequences into micro-batches of at most ``max_tokens_per_mb`` tokens.

    Args:
        seqlens: token count of each sequence.
        max_tokens_per_mb: token cap per micro-batch.
        min_mbs: at least this many micro-batches.
        divisor: the number of micro-batches is a multiple of this.

    Returns:
        Lists of sequence indices (each sorted), one per micro-batch; deterministic for
        the same input.

    Raises:
        ValueError: a sequence longer than the cap (naming its index and length), or no
            valid count of micro-batches (k must not exceed the number of sequences).
    """
    lens = [int(n) for n in seqlens]
    cap = int(max_tokens_per_mb)
    _validate(lens, cap, min_mbs, divisor)
    bound = _lower_bound(np.sort(np.asarray(lens, dtype=np.int64)), cap)
    # Two budgets for the per-bin spare (see _pack_dense); the strict one only if needed.
    bins = _pack_dense(lens, cap, target_bins=bound + 1)
    if len(bins) > bound:
        strict = _pack_dense(lens, cap, target_bins=bound)
        bins = strict if len(strict) < len(bins) else bins
    k = _round_up(max(len(bins), min_mbs), divisor)
    # Rounding to the divisor can overshoot; a balanced LPT packing may fit in between.
    k_min = _round_up(max(bound, min_mbs), divisor)
    for k_try in range(k_min, min(k, len(lens) + 1), divisor)[:_MAX_LPT_TRIES]:
        if (lpt := _pack_lpt(lens, cap, k_try)) is not None:
            return _resize(lpt, lens, cap, k_try)
    if k > len(lens):
        raise ValueError(
            f"cannot split {len(lens)} sequences into {k} micro-batches (min_mbs={min_mbs}, "
            f"divisor={divisor}) without an empty one; lower min_mbs/divisor or add sequences"
        )
    return _resize(bins, lens, cap, k)


def allocate_micro_batches_synced(
    seqlens: Sequence[int],
    max_tokens_per_mb: int,
    *,
    group: dist.ProcessGroup | None,
    min_mbs: int = 1,
    divisor: int = 1,
) -> list[list[int]]:
    """``allocate_micro_batches`` with the same micro-batch count on every rank of ``group``.

    Each rank packs its own sequences, the ranks all-reduce the maximum count, and the
    ranks with fewer micro-batches re-pack to that count (always possible by splitting
    their own packing, as long as they hold at least that many sequences).
    """
    lens = [int(n) for n in seqlens]
    cap = int(max_tokens_per_mb)
    bins = allocate_micro_batches(lens, cap, min_mbs=min_mbs, divisor=divisor)
    count = torch.tensor([len(bins)], dtype=torch.int64)
    collectives.all_reduce(count, group, op=dist.ReduceOp.MAX)  # on the group's device and back
    k = int(count.item())
    if k > len(lens):
        raise ValueError(
            f"another data-parallel rank needs {k} micro-batches but this rank holds only "
            f"{len(lens)} sequences; give every rank at least {k} sequences or raise "
            f"max_tokens_per_mb={cap}"
        )
    return bins if k == len(bins) else _resize(bins, lens, cap, k)


# --------------------------------------------------------------------------- internals


def _validate(lens: list[int], cap: int, min_mbs: int, divisor: int) -> None:
    if cap <= 0:
        raise ValueError(f"max_tokens_per_mb={cap} must be > 0")
    if min_mbs < 1 or divisor < 1:
        raise ValueError(f"min_mbs={min_mbs} and divisor={divisor} must be >= 1")
    if not lens:
        raise ValueError("allocate_micro_batches() needs at least one sequence")
    for i, n in enumerate(lens):
        if n < 0:
            raise ValueError(f"sequence {i} has negative length {n}")
        if n > cap:
            raise ValueError(
                f"sequence {i} has {n} tokens, more than max_tokens_per_mb={cap}; raise "
                f"the cap or lower the prompt/response length limits"
            )


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _resize(bins: list[list[int]], lens: list[int], cap: int, k: int) -> list[list[int]]:
    """Spreads a feasible packing over k >= len(bins) bins, balanced, none empty."""
    if k > len(bins):
        bins = _pack_lpt(lens, cap, k) or [list(b) for b in bins] + [[] for _ in range(k - len(bins))]
    _fill_empty(bins, lens)
    _balance(bins, lens)
    return sorted((sorted(b) for b in bins), key=lambda b: b[0])


def _pack_lpt(lens: list[int], cap: int, k: int) -> list[list[int]] | None:
    """Largest first onto the lightest bin; None if some sequence fits nowhere."""
    heap = [(0, b) for b in range(k)]
    bins: list[list[int]] = [[] for _ in range(k)]
    for i in sorted(range(len(lens)), key=lambda i: (-lens[i], i)):
        load, b = heap[0]
        if load + lens[i] > cap:  # the lightest bin has the most room
            return None
        bins[b].append(i)
        heapq.heapreplace(heap, (load + lens[i], b))
    return bins


# Subset-sum candidates per bin: the longest sequences that fit plus an even spread of
# shorter ones; enough for exact fills among thousands of sequences, cheap enough for 8k.
_N_LONGEST, _N_SPREAD = 32, 64
# The shorter half of the pool is held back while a fill without it is good enough:
# short sequences are the only ones that fit beside near-cap (truncated) responses, and
# spending them early leaves a tail of mid-size sequences that pack badly.
_RESERVE = 0.5
# A gap above this would make the bitset search costly in memory; fill greedily instead.
_MAX_EXACT_GAP = 1 << 18
# Bin counts between the lower bound and the dense packing tried with LPT (cheap, rarely
# needed: mostly when rounding up to the divisor overshoots).
_MAX_LPT_TRIES = 4
# Lighter bins the balancing search pairs with the heaviest one before it gives up.
_BALANCE_PARTNERS = 32


def _pack_dense(lens: list[int], cap: int, target_bins: int) -> list[list[int]]:
    """Bin by bin: the longest sequence left, then the pool subset that best fills the rest.

    A fill that leaves no more spare than ``target_bins`` bins could afford on average is
    taken from the longer half of the pool; only a worse one reaches into the short half.
    """
    order = np.argsort(np.asarray(lens, dtype=np.int64), kind="stable")
    pool = np.asarray(lens, dtype=np.int64)[order]  # ascending lengths
    pool_ids = order.tolist()
    good_slack = (target_bins * cap - sum(lens)) / target_bins
    bins = []
    while pool_ids:
        members = [pool_ids.pop()]
        pool = pool[:-1]
        gap = cap - lens[members[0]]
        top = int(np.searchsorted(pool, gap, side="right"))  # pool[:top] fit the gap
        if top:
            taken = _fill(pool, top, gap, good_slack, reserve=int(len(pool) * _RESERVE))
            for p in sorted(taken, reverse=True):
                members.append(pool_ids.pop(p))
            pool = np.delete(pool, taken)
        bins.append(members)
    return bins


def _lower_bound(sorted_lens: np.ndarray, cap: int) -> int:
    """Martello–Toth L2 bound on the bin count (≥ ⌈Σ/cap⌉).

    For every threshold α ≤ cap/2: sequences longer than cap − α each need a bin of their
    own, so do those over cap/2, and the room left beside the latter must absorb the
    sequences in [α, cap/2] or they open more bins. Many truncated responses (longer than
    cap/2) push the true optimum well above ⌈Σ/cap⌉; this bound sees that.
    """
    a = sorted_lens
    prefix = np.concatenate([[0], np.cumsum(a)])
    alphas = np.unique(a[a <= cap // 2])
    alphas = np.concatenate([[0], alphas])
    half_hi = np.searchsorted(a, cap // 2, side="right")  # a[:half_hi] <= cap/2
    j1_lo = np.searchsorted(a, cap - alphas, side="right")  # a[j1_lo:] > cap - α
    j3_lo = np.searchsorted(a, alphas, side="left")  # a[j3_lo:half_hi] in [α, cap/2]
    n_j1 = len(a) - j1_lo
    n_j2 = np.maximum(j1_lo - half_hi, 0)
    sum_j2 = prefix[np.maximum(j1_lo, half_hi)] - prefix[half_hi]
    sum_j3 = prefix[half_hi] - prefix[j3_lo]
    extra = np.maximum(0, -(-(sum_j3 - (n_j2 * cap - sum_j2)) // cap))
    return int(max(1, -(-int(prefix[-1]) // cap), (n_j1 + n_j2 + extra).max()))


def _fill(pool: np.ndarray, top: int, gap: int, good_slack: float, reserve: int) -> list[int]:
    """Pool positions (all < top) of a subset summing to at most ``gap``, as close as found."""
    if gap > _MAX_EXACT_GAP:
        taken, p = [], top
        while (p := int(np.searchsorted(pool[:p], gap, side="right"))) > 0:
            p -= 1
            taken.append(p)
            gap -= int(pool[p])
        return taken
    if top > reserve:
        positions = _candidates(reserve, top)
        chosen, slack = _subset_sum([int(pool[p]) for p in positions], gap)
        if slack <= good_slack:
            return [positions[c] for c in chosen]
    positions = _candidates(0, top)
    chosen, _ = _subset_sum([int(pool[p]) for p in positions], gap)
    return [positions[c] for c in chosen]


def _candidates(lo: int, top: int) -> list[int]:
    """Positions in [lo, top), descending: the longest few, then an even spread below."""
    longest = list(range(top - 1, max(top - 1 - _N_LONGEST, lo - 1), -1))
    rest = top - len(longest)
    spread = []
    if rest > lo:
        spread = np.linspace(rest - 1, lo, min(_N_SPREAD, rest - lo)).astype(int).tolist()
    return list(dict.fromkeys(longest + spread))


def _subset_sum(sizes: list[int], gap: int) -> tuple[list[int], int]:
    """Indices of a subset with the largest sum <= gap, and the gap left.

    Reachable sums are a Python-int bitset (bit s set: sum s reachable). The bitset before
    each item is kept, and the subset is read back from the last item, skipping every item
    the target was reachable without, so earlier (longer) items are preferred.
    """
    mask = (1 << (gap + 1)) - 1
    reach, history = 1, []
    for s in sizes:
        history.append(reach)
        reach = (reach | (reach << s)) & mask
        if reach >> gap & 1:
            break
    best = reach.bit_length() - 1
    target, chosen = best, []
    for t in range(len(history) - 1, -1, -1):
        if not history[t] >> target & 1:
            chosen.append(t)
            target -= sizes[t]
    return chosen, gap - best


def _fill_empty(bins: list[list[int]], lens: list[int]) -> None:
    """Gives every empty bin one sequence from the heaviest bin that holds several."""
    for empty in (b for b in bins if not b):
        donor = max((b for b in bins if len(b) > 1), key=lambda b: sum(lens[i] for i in b))
        empty.append(donor.pop(donor.index(min(donor, key=lambda i: (lens[i], i)))))


def _balance(bins: list[list[int]], lens: list[int], max_rounds: int = 100_000) -> None:
    """Local search: lower the heaviest bin by a move or swap with a lighter bin.

    Every accepted step lowers the heavier of the two bins and keeps the lighter one
    below the old maximum, so the sorted load vector decreases and the loop ends; the
    cap holds because no bin ever exceeds the current maximum.
    """
    loads = np.array([sum(lens[i] for i in b) for b in bins], dtype=np.int64)
    for _ in range(max_rounds):
        heavy = int(np.argmax(loads))
        light = int(np.argmin(loads))  # usually the lightest bin takes the step
        step = _best_step(bins[heavy], bins[light], lens, int(loads[heavy] - loads[light]))
        if step is None:
            for light in np.argsort(loads, kind="stable")[1:_BALANCE_PARTNERS].tolist():
                gap = int(loads[heavy] - loads[light])
                if gap <= 1:
                    return  # no lighter bin can take anything from the heaviest one
                if (step := _best_step(bins[heavy], bins[light], lens, gap)) is not None:
                    break
            else:
                return
        out, back = step
        bins[heavy].remove(out)
        bins[light].append(out)
        if back is not None:
            bins[light].remove(back)
            bins[heavy].append(back)
        shift = lens[out] - (lens[back] if back is not None else 0)
        loads[heavy] -= shift
        loads[light] += shift


def _best_step(heavy: list[int], light: list[int], lens: list[int], gap: int):
    """The move (i, None) or swap (i, j) whose shift is closest to gap / 2 within (0, gap)."""
    best, best_err = None, gap  # err = |gap - 2 * shift| must beat gap to help
    if len(heavy) > 1:
        for i in heavy:
            err = abs(gap - 2 * lens[i])
            if 0 < lens[i] < gap and err < best_err:
                best, best_err = (i, None), err
    for i in heavy:
        for j in light:
            shift = lens[i] - lens[j]
            err = abs(gap - 2 * shift)
            if 0 < shift < gap and err < best_err:
                best, best_err = (i, j), err
    return best
