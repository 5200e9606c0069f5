"""``algo.normalize`` against an independent numpy implementation of AReaL's definitions.

The reference is written from AReaL's ``Normalization`` (areal/utils/data.py, HEAD), not
from our code: for a set S of entries (the whole batch, or one group of ``group_size``
contiguous entries) and mask m,

    mean(S) = Σ_S m·x / Σ_S m            (0 when Σ_S m = 0; mean_level none: 0)
    std(S)  = sqrt(Σ_S m·(x − μ)² / d)   μ = the mean of the *mean* level, d = n or n − 1
              (1 when d ≤ 0, i.e. an empty set, or one entry with the unbiased estimator)
    out     = m·(x − μ) / (σ + eps)      (std_level none: σ = 1, eps = 0)

computed in float64. One deliberate difference: AReaL returns x unchanged when every
entry is masked out; ours returns zeros, as for every other masked-out entry.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from _dist import run_gloo

from areal_mcore.algo import normalize

LEVELS = ("group", "batch", "none")
EPS = 1e-5


def _reference(x, mask, mean_level, std_level, group_size, unbiased, eps=EPS):
    x = np.asarray(x, dtype=np.float64)
    m = np.ones_like(x) if mask is None else np.asarray(mask, dtype=np.float64)

    def sets(level):  # index lists the statistics of `level` are taken over
        if level == "batch":
            return [list(range(len(x)))]
        return [list(range(i, i + group_size)) for i in range(0, len(x), group_size)]

    mu = np.zeros_like(x)
    if mean_level != "none":
        for s in sets(mean_level):
            n = sum(m[i] for i in s)
            mean = sum(m[i] * x[i] for i in s) / n if n > 0 else 0.0
            for i in s:
                mu[i] = mean
    sigma, e = np.ones_like(x), 0.0
    if std_level != "none":
        e = eps
        for s in sets(std_level):
            n = sum(m[i] for i in s)
            d = n - 1 if unbiased else n
            sq = sum(m[i] * (x[i] - mu[i]) ** 2 for i in s)
            std = float(np.sqrt(sq / d)) if d > 0 else 1.0
            for i in s:
                sigma[i] = std
    return m * (x - mu) / (sigma + e)


def _cases(group_size, seed):
    """Values with all-equal groups (at, off and away from the batch mean), ±5 rewards,
    and random ones; with and without a mask (one with an all-masked group)."""
    rng = np.random.default_rng(seed)
    n_groups = 4 if group_size > 1 else 12
    groups = [np.full(group_size, 5.0), np.full(group_size, -5.0),  # all-equal groups
              rng.choice([-5.0, 5.0], group_size), rng.normal(0.3, 2.0, group_size)]
    groups += [rng.normal(0, 1, group_size) for _ in range(n_groups - len(groups))]
    x = np.concatenate(groups)
    mask = rng.random(len(x)) < 0.7
    mask[:group_size] = False  # one group (or sample) entirely masked out
    mask[group_size] = True
    return [(x, None), (x, mask), (np.full(len(x), 2.5), None)]


COMBOS = list(itertools.product(LEVELS, LEVELS, (False, True)))


@pytest.mark.parametrize("group_size", [1, 16])
@pytest.mark.parametrize("mean_level, std_level, unbiased", COMBOS)
def test_normalize_matches_areal_definitions_for_every_level_pair(mean_level, std_level, unbiased, group_size):
    for x, mask in _cases(group_size, seed=group_size):
        got = normalize(torch.tensor(x, dtype=torch.float32), mean_level=mean_level, std_level=std_level,
                        group_size=group_size, unbiased_std=unbiased, eps=EPS,
                        mask=None if mask is None else torch.tensor(mask))
        # float32 inputs: the reference sees the same rounded values
        want = _reference(np.float32(x), mask, mean_level, std_level, group_size, unbiased)
        assert got.dtype == torch.float32
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, atol=1e-6)


def test_normalize_single_sample_groups_never_divide_by_eps():
    x = torch.tensor([3.0, -2.0, 0.0, 7.0])
    for mean_level, unbiased in itertools.product(LEVELS, (False, True)):
        out = normalize(x, mean_level=mean_level, std_level="group", group_size=1, unbiased_std=unbiased)
        assert out.abs().max() <= 7.0, (mean_level, unbiased, out)


def test_normalize_all_masked_batch_returns_zeros():
    out = normalize(torch.tensor([1.0, 2.0]), mean_level="batch", std_level="batch",
                    mask=torch.zeros(2, dtype=torch.bool))
    assert out.tolist() == [0.0, 0.0]


def _dp_worker(rank, world, shards, masks):
    import torch.distributed as dist

    out = {}
    for mean_level, std_level, unbiased in COMBOS:
        if "group" in (mean_level, std_level):
            continue  # groups live on one rank: nothing to reduce
        out[(mean_level, std_level, unbiased)] = normalize(
            torch.tensor(shards[rank], dtype=torch.float32), mean_level=mean_level, std_level=std_level,
            unbiased_std=unbiased, mask=torch.tensor(masks[rank]), group=dist.group.WORLD).numpy()
    return out


@pytest.mark.multirank
def test_normalize_batch_levels_over_two_dp_ranks_equal_the_reference_on_the_whole_batch():
    rng = np.random.default_rng(3)
    shards = [np.float32(rng.normal(1.0, 2.0, n)) for n in (7, 12)]  # uneven shares
    masks = [rng.random(len(s)) < 0.6 for s in shards]
    results = run_gloo(_dp_worker, 2, shards, masks)
    x, mask = np.concatenate(shards), np.concatenate(masks)
    for key in results[0]:
        want = _reference(x, mask, *key[:2], group_size=1, unbiased=key[2])
        got = np.concatenate([results[0][key], results[1][key]])
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=str(key))
