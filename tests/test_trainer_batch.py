"""Rollout samples -> packed training batch with boba advantages, against a plain loop."""

from __future__ import annotations

import torch

from areal_mcore.algo.config import NormConfig, PPOConfig
from areal_mcore.packing import unpack
from areal_mcore.rollout.trajectory import Sample
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


def _cut(samples, keep):
    """The samples with only the response tokens ``keep(sample)`` marks."""
    out = []
    for s in samples:
        k = keep(s)
        out.append(Sample(group=s.group, prompt_ids=s.prompt_ids, output_ids=[t for t, m in zip(s.output_ids, k) if m],
                          logprobs=[x for x, m in zip(s.logprobs, k) if m],
                          versions=[v for v, m in zip(s.versions, k) if m], reward=s.reward,
                          finish_reason=s.finish_reason, start_version=s.start_version))
    return out


def test_tool_tokens_get_zero_gradient_and_the_rest_trains_as_if_they_were_absent():
    """A multi-turn trajectory's tool output (version -1, logprob 0) is context: against the
    same trajectories with those tokens cut out, the loss, each agent token's gradient and
    the advantages are the same, and the tool tokens' gradient is 0. A discount below 1
    checks that GAE runs over the agent's tokens only, as if the turns were adjacent."""
    from areal_mcore.algo import ppo_actor_loss

    n = 4
    g = torch.Generator().manual_seed(5)
    multi = []
    for s in _samples(n=n, seed=1):  # each response: agent tokens, a tool's output, agent tokens
        k, tool = len(s.output_ids), int(torch.randint(1, 5, (1,), generator=g))
        cut = int(torch.randint(0, k + 1, (1,), generator=g))
        s.output_ids[cut:cut] = torch.randint(0, 100, (tool,), generator=g).tolist()
        s.logprobs[cut:cut] = [0.0] * tool
        s.versions[cut:cut] = [-1] * tool
        multi.append(s)
    ppo = PPOConfig(discount=0.9, gae_lambda=0.8, reward_bias=-0.5, reward_scaling=10.0, use_decoupled_loss=True,
                    reward_norm=NormConfig(mean_level="group", std_level="group", group_size=n),
                    adv_norm=NormConfig(mean_level="batch", std_level="batch"))
    # The policy's logprobs of every token, drawn once per trajectory token; the cut batch
    # reads the same values for the tokens it keeps.
    logp = [(-torch.rand(len(s.prompt_ids) + len(s.output_ids), generator=g)).tolist() for s in multi]
    agent = [[True] * len(s.prompt_ids) + [v >= 0 for v in s.versions] for s in multi]

    def loss_and_grad(samples, logp_lists):
        batch = to_train_batch(samples, ppo)
        f = batch.fields
        logp_T = torch.tensor([x for seq in logp_lists for x in seq], requires_grad=True)
        prox_T = logp_T.detach() + 0.05 * torch.sin(torch.arange(logp_T.numel(), dtype=torch.float32))
        loss, _ = ppo_actor_loss(logp_T, prox_T, f["adv"], f["loss_mask"], num_global_tokens=f["loss_mask"].sum(),
                                 eps_clip=0.2, behave_logprobs_T=f["behave"], cu_seqlens_B1=batch.cu_seqlens_padded)
        loss.backward()
        return loss, logp_T.grad, f

    loss, grad, f = loss_and_grad(multi, logp)
    keep = torch.tensor([m for seq in agent for m in seq])
    cut_logp = [[x for x, m in zip(seq, a) if m] for seq, a in zip(logp, agent)]
    cut_loss, cut_grad, cut_f = loss_and_grad(_cut(multi, lambda s: [v >= 0 for v in s.versions]), cut_logp)

    assert (~keep).sum() > 0 and torch.all(grad[~keep] == 0) and torch.all(f["adv"][~keep] == 0)
    assert int(f["loss_mask"].sum()) == int(cut_f["loss_mask"].sum())
    torch.testing.assert_close(loss, cut_loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad[keep], cut_grad, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(f["adv"][keep], cut_f["adv"], rtol=1e-6, atol=1e-7)
