"""Rollout samples -> packed training batch with boba advantages, against a plain loop."""

from __future__ import annotations

import torch

from areal_mcore.algo.config import NormConfig, PPOConfig
from areal_mcore.packing import unpack
from areal_mcore.rollout.controller import Sample
from areal_mcore.trainer.batch import to_train_batch


def _samples(n_groups=3, n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for gi in range(n_groups):
        prompt = torch.randint(0, 100, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n):
            k = int(torch.randint(1, 9, (1,), generator=g))
            out.append(Sample(group=gi, prompt_ids=prompt,
                              output_ids=torch.randint(0, 100, (k,), generator=g).tolist(),
                              logprobs=(-torch.rand(k, generator=g)).tolist(), versions=[3] * k,
                              reward=float(torch.randint(0, 2, (1,), generator=g)),
                              finish_reason="stop", start_version=3))
    return out


def test_boba_advantages_equal_a_plain_python_reference():
    n = 4
    ppo = PPOConfig(reward_bias=-0.5, reward_scaling=10.0, reward_clip=20.0,
                    reward_norm=NormConfig(mean_level="group", std_level="group", group_size=n),
                    adv_norm=NormConfig(mean_level="batch", std_level="batch"))
    samples = _samples(n=n)
    batch = to_train_batch(samples, ppo, pad_to_multiple_of=8)
    seqs, f = unpack(batch)

    shaped = [max(-20.0, min(20.0, (s.reward - 0.5) * 10)) for s in samples]  # ±5
    normed = []
    for i in range(0, len(shaped), n):
        grp = torch.tensor(shaped[i:i + n])
        normed += ((grp - grp.mean()) / (grp.std(unbiased=False) + 1e-5)).tolist()
    token_adv = torch.tensor([a for s, a in zip(samples, normed) for _ in s.output_ids])
    token_adv = (token_adv - token_adv.mean()) / (token_adv.std(unbiased=False) + 1e-5)

    got = torch.cat([a[m] for a, m in zip(f["adv"], f["loss_mask"])])
    torch.testing.assert_close(got, token_adv, atol=1e-5, rtol=0)
    for s, seq, m, b, v, a in zip(samples, seqs, f["loss_mask"], f["behave"], f["versions"], f["adv"]):
        assert seq.tolist() == s.prompt_ids + s.output_ids
        assert m.tolist() == [False] * len(s.prompt_ids) + [True] * len(s.output_ids)
        torch.testing.assert_close(b[m], torch.tensor(s.logprobs))
        assert v[m].tolist() == s.versions and (b[~m] == 0).all() and (a[~m] == 0).all()
    assert batch.input_ids.numel() % 8 == 0


def test_without_normalisation_every_response_token_gets_the_shaped_reward():
    samples = _samples(n_groups=2, n=2, seed=1)
    batch = to_train_batch(samples, PPOConfig(reward_bias=-0.5, reward_scaling=10.0))
    _, f = unpack(batch)
    for s, a, m in zip(samples, f["adv"], f["loss_mask"]):
        assert torch.allclose(a[m], torch.full((len(s.output_ids),), (s.reward - 0.5) * 10))
