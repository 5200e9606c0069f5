import math

import numpy as np
import pytest
import torch.distributed as dist
from _dist import run_gloo
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_mcore.packing import allocate_micro_batches, allocate_micro_batches_synced
from bench.allocator import ffd_fewest_seqs, rl_length_mix

# (cap, max_new_tokens): the 1.5B example and the 7B boba run.
SETTINGS = [(16384, 8192), (30720, 27648)]


def _check_packing(bins, lens, cap):
    assert sorted(i for b in bins for i in b) == list(range(len(lens)))
    assert all(b for b in bins), "empty micro-batch"
    loads = [sum(lens[i] for i in b) for b in bins]
    assert max(loads) <= cap
    return loads


def _realistic(seed, n, setting, median_frac, sigma):
    cap, max_new = SETTINGS[setting]
    rng = np.random.default_rng(seed)
    return rl_length_mix(rng, n, max_new, prompt_range=(50, 1024),
                         median_frac=median_frac, sigma=sigma), cap


def _optimal_bins(lens, cap):
    """Exact minimum bin count by DP over subsets: (bins, load of the open bin) per mask."""
    n = len(lens)
    best = [(n + 1, 0)] * (1 << n)
    best[0] = (1, 0)
    for mask in range(1 << n):
        bins, load = best[mask]
        for i in range(n):
            if not mask >> i & 1:
                nxt = (bins, load + lens[i]) if load + lens[i] <= cap else (bins + 1, lens[i])
                best[mask | 1 << i] = min(best[mask | 1 << i], nxt)
    return best[-1][0]


@settings(max_examples=200, deadline=None)
@given(
    lens=st.lists(st.integers(0, 100), min_size=1, max_size=60),
    cap=st.integers(100, 400),
    min_mbs=st.integers(1, 8),
    divisor=st.integers(1, 4),
)
def test_any_input_respects_cap_count_rules_and_is_deterministic(lens, cap, min_mbs, divisor):
    lower = max(math.ceil(sum(lens) / cap), min_mbs)
    try:
        bins = allocate_micro_batches(lens, cap, min_mbs=min_mbs, divisor=divisor)
    except ValueError as e:
        # Only when no count that is a multiple of divisor and <= n can hold the sequences.
        assert "without an empty one" in str(e)
        k_max = len(lens) // divisor * divisor
        assert k_max < lower or (len(lens) <= 12 and _optimal_bins(lens, cap) > k_max)
        return
    _check_packing(bins, lens, cap)
    k = len(bins)
    assert k >= lower and k % divisor == 0 and k <= len(lens)
    assert bins == allocate_micro_batches(lens, cap, min_mbs=min_mbs, divisor=divisor)


@settings(max_examples=100, deadline=None)
@given(lens=st.lists(st.integers(1, 60), min_size=1, max_size=10), cap=st.integers(60, 120))
def test_small_inputs_need_at_most_one_bin_more_than_optimal(lens, cap):
    assert len(allocate_micro_batches(lens, cap)) <= _optimal_bins(lens, cap) + 1


@settings(max_examples=12, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.sampled_from([256, 512, 1024, 2048, 4096, 8192]),
    setting=st.sampled_from([0, 1]),
    median_frac=st.floats(0.1, 0.3),
    sigma=st.floats(0.5, 1.1),
)
def test_realistic_mix_never_exceeds_cap_or_baseline_a_and_is_balanced(seed, n, setting, median_frac, sigma):
    lens, cap = _realistic(seed, n, setting, median_frac, sigma)
    bins = allocate_micro_batches(lens, cap)
    loads = _check_packing(bins, lens, cap)
    assert len(bins) <= len(ffd_fewest_seqs(lens, cap))
    assert max(loads) / np.mean(loads) <= 1.05


def test_realistic_mixes_within_one_of_lower_bound_on_95_percent():
    rng = np.random.default_rng(2026)
    within, total = 0, 40
    for trial in range(total):
        lens, cap = _realistic(int(rng.integers(2**31)), int(rng.choice([256, 512, 1024, 2048, 4096, 8192])),
                               trial % 2, rng.uniform(0.1, 0.3), rng.uniform(0.5, 1.1))
        bins = allocate_micro_batches(lens, cap)
        within += len(bins) <= math.ceil(sum(lens) / cap) + 1
    assert within / total >= 0.95, f"only {within}/{total} batches within ⌈Σ/cap⌉ + 1"


def test_tight_hand_case_reaches_lower_bound():
    # 3 bins of exactly 10: first-fit decreasing needs 4 ({6,3}, {5,4}, {4,4}... ).
    lens = [6, 5, 4, 4, 3, 3, 3, 2]
    assert sum(lens) == 30
    bins = allocate_micro_batches(lens, 10)
    assert len(bins) == 3
    assert sorted(sum(lens[i] for i in b) for b in bins) == [10, 10, 10]


def test_oversize_sequence_error_names_index_and_length():
    with pytest.raises(ValueError, match=r"sequence 2 has 17 tokens.*max_tokens_per_mb=16"):
        allocate_micro_batches([3, 4, 17, 2], 16)


def test_min_mbs_larger_than_sequence_count_is_an_error():
    with pytest.raises(ValueError, match="4 micro-batches"):
        allocate_micro_batches([1, 2, 3], 100, min_mbs=4)


def test_min_mbs_and_divisor_spread_sequences_evenly():
    lens = rl_length_mix(np.random.default_rng(0), 512, 8192)
    bins = allocate_micro_batches(lens, 16384, min_mbs=150, divisor=4)
    loads = _check_packing(bins, lens, 16384)
    assert len(bins) == 152
    assert max(loads) / np.mean(loads) <= 1.05


def _synced_worker(rank, world_size):
    lens = rl_length_mix(np.random.default_rng(rank), 64 + 64 * rank, 8192)
    own = len(allocate_micro_batches(lens, 16384, divisor=2))
    bins = allocate_micro_batches_synced(lens, 16384, group=dist.group.WORLD, divisor=2)
    return lens, own, bins


@pytest.mark.multirank
def test_synced_allocator_makes_dp_ranks_agree_on_count():
    (lens0, own0, bins0), (lens1, own1, bins1) = run_gloo(_synced_worker, 2)
    assert own0 < own1, "the ranks should need different counts on their own"
    assert len(bins0) == len(bins1) == own1
    _check_packing(bins0, lens0, 16384)
    _check_packing(bins1, lens1, 16384)
