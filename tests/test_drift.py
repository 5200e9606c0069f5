"""The train-vs-rollout drift stats (algo/drift.py) against a plain reference, and the
alarm's config."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from areal_mcore.algo.drift import BINS_PER_DECADE, reduce_rollout_gap, rollout_gap_sums


def _batch(T=2000, seed=0):
    g = torch.Generator().manual_seed(seed)
    behave = -torch.rand(T, generator=g, dtype=torch.float64) * 4
    prox = behave + torch.randn(T, generator=g, dtype=torch.float64) * 0.02
    mask = torch.rand(T, generator=g) < 0.8
    versions = torch.randint(3, 6, (T,), generator=g)  # proximal version 5: staleness 0, 1, 2
    versions[~mask] = -1
    return behave, prox, mask, versions


def test_gap_stats_equal_a_plain_reference_per_staleness_and_p99_within_one_bin():
    behave, prox, mask, versions = _batch()
    behave[3], prox[7] = float("-inf"), float("nan")  # broken records are left out
    mask[3] = mask[7] = True
    got = reduce_rollout_gap(rollout_gap_sums(behave, prox, mask, versions, 5))
    kept = [i for i in range(len(mask)) if mask[i] and i not in (3, 7)]
    d = [float(prox[i] - behave[i]) for i in kept]
    assert got["tokens"] == len(kept)
    assert got["gap_mean_abs"] == pytest.approx(sum(abs(x) for x in d) / len(d), rel=1e-12)
    assert got["k3_kl"] == pytest.approx(sum(math.expm1(x) - x for x in d) / len(d), rel=1e-9)
    p99 = sorted(abs(x) for x in d)[math.ceil(0.99 * len(d)) - 1]
    assert p99 <= got["gap_p99_abs"] <= p99 * 10 ** (1 / BINS_PER_DECADE)
    for s in (0, 1, 2):
        ds = [x for i, x in zip(kept, d) if 5 - int(versions[i]) == s]
        assert got[f"tokens_stale{s}"] == len(ds)
        assert got[f"gap_mean_abs_stale{s}"] == pytest.approx(sum(abs(x) for x in ds) / len(ds), rel=1e-12)
    assert "tokens_stale3" not in got


def test_gap_stats_summed_over_two_ranks_equal_one_rank_holding_the_batch():
    behave, prox, mask, versions = _batch(seed=1)
    whole = reduce_rollout_gap(rollout_gap_sums(behave, prox, mask, versions, 5))
    halves = [rollout_gap_sums(behave[s], prox[s], mask[s], versions[s], 5) for s in (slice(0, 700), slice(700, None))]
    assert reduce_rollout_gap(halves[0] + halves[1]) == pytest.approx(whole, rel=1e-12)


def test_identical_logprobs_give_zero_gap_and_no_loss_tokens_give_zeros():
    behave, _, mask, versions = _batch(seed=2)
    same = reduce_rollout_gap(rollout_gap_sums(behave, behave.clone(), mask, versions, 5))
    assert same["gap_mean_abs"] == same["k3_kl"] == 0.0 and same["gap_p99_abs"] <= 1e-9
    empty = reduce_rollout_gap(rollout_gap_sums(behave, behave, torch.zeros_like(mask), versions, 5))
    assert empty == {"tokens": 0.0, "gap_mean_abs": 0.0, "gap_p99_abs": 0.0, "k3_kl": 0.0}


def test_the_drift_alarm_is_on_by_default_at_the_dtypes_threshold_needs_a_positive_gap_and_the_proximal():
    from areal_mcore.config import ConfigError, load_config

    configs = Path(__file__).parents[1] / "configs"
    tiny = configs / "tiny_cpu.yaml"
    fp32 = {tiny, configs / "tiny_tool_cpu.yaml"}  # the tiny runs: all float32
    for shipped in configs.glob("*.yaml"):  # every PPO config: on, bf16's threshold beyond the tiny runs'
        cfg = load_config(shipped)
        if cfg.trainer is not None and cfg.rollout is not None:
            assert cfg.trainer.max_rollout_logprob_gap == (1e-3 if shipped in fp32 else 0.1), shipped
    assert load_config(tiny, ["weight_sync.dtype=bfloat16"]).trainer.max_rollout_logprob_gap == 0.1
    assert load_config(tiny, ["trainer.drift_alarm=false"]).trainer.max_rollout_logprob_gap is None
    assert load_config(tiny, ["trainer.max_rollout_logprob_gap=0.5"]).trainer.max_rollout_logprob_gap == 0.5
    # A method without the proximal forward pass: the default stays off, a set value is refused.
    assert load_config(tiny, ["ppo.use_decoupled_loss=true", "ppo.prox_logp_method=loglinear"]
                       ).trainer.max_rollout_logprob_gap is None
    with pytest.raises(ConfigError, match=r"trainer.max_rollout_logprob_gap=-1.0 must be > 0"):
        load_config(tiny, ["trainer.max_rollout_logprob_gap=-1"])
    for method in ("loglinear", "reuse_train_logp"):  # no proximal forward pass to compare with
        with pytest.raises(ConfigError, match=r"trainer.max_rollout_logprob_gap=0.01 needs ppo.prox_logp_method "
                                              r"recompute or metrics"):
            load_config(tiny, ["trainer.max_rollout_logprob_gap=0.01", "ppo.use_decoupled_loss=true",
                               f"ppo.prox_logp_method={method}"])
    load_config(tiny, ["trainer.max_rollout_logprob_gap=0.01", "ppo.use_decoupled_loss=true",
                       "ppo.prox_logp_method=metrics"])
