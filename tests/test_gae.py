import pytest
import torch

from areal_mcore.algo import gae_packed


def _reference_gae(rewards, lengths, values, mask, gamma, lam):
    """Plain Python loop, one sequence at a time, over its action tokens in reverse."""
    adv = [0.0] * sum(lengths)
    ret = [0.0] * sum(lengths)
    start = 0
    for b, n in enumerate(lengths):
        actions = [t for t in range(start, start + n) if mask[t]]
        last_gae, next_value = 0.0, 0.0
        for j, t in enumerate(reversed(actions)):
            r = rewards[b] if j == 0 else 0.0
            v = values[t] if values is not None else 0.0
            delta = r + gamma * next_value - v
            last_gae = delta + gamma * lam * last_gae
            adv[t], ret[t] = last_gae, last_gae + v
            next_value = v
        start += n
    return torch.tensor(adv), torch.tensor(ret)


def _random_packed(seed, with_values, masked):
    g = torch.Generator().manual_seed(seed)
    B = int(torch.randint(1, 9, (1,), generator=g))
    lengths = torch.randint(1, 30, (B,), generator=g).tolist()
    T = sum(lengths)
    rewards = torch.randn(B, generator=g)
    values = torch.randn(T, generator=g) if with_values else None
    mask = (torch.rand(T, generator=g) > 0.3) if masked else torch.ones(T, dtype=torch.bool)
    cu = torch.tensor([0] + torch.cumsum(torch.tensor(lengths), 0).tolist(), dtype=torch.int32)
    return rewards, lengths, cu, values, mask


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.99, 0.95), (1.0, 0.9), (0.5, 1.0), (0.0, 0.3)])
@pytest.mark.parametrize("with_values", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_gae_matches_python_reference_on_random_packed_batches(gamma, lam, with_values, masked):
    for seed in range(10):
        rewards, lengths, cu, values, mask = _random_packed(seed, with_values, masked)
        adv, ret = gae_packed(rewards, cu, gamma=gamma, lam=lam, values_T=values,
                              loss_mask_T=mask if masked else None)
        ref_adv, ref_ret = _reference_gae(rewards.tolist(), lengths,
                                          None if values is None else values.tolist(),
                                          mask.tolist(), gamma, lam)
        torch.testing.assert_close(adv, ref_adv, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ret, ref_ret, atol=1e-5, rtol=1e-5)


def test_boba_gae_gives_every_response_token_its_sequence_reward():
    # Two sequences: prompt (mask 0) then response (mask 1); γ = λ = 1, no critic.
    mask = torch.tensor([0, 0, 1, 1, 1, 0, 1, 1], dtype=torch.bool)
    cu = torch.tensor([0, 5, 8], dtype=torch.int32)
    adv, ret = gae_packed(torch.tensor([5.0, -5.0]), cu, gamma=1.0, lam=1.0, loss_mask_T=mask)
    assert adv.tolist() == [0, 0, 5, 5, 5, 0, -5, -5]
    assert torch.equal(adv, ret)


def test_sequence_without_action_tokens_gets_nothing():
    mask = torch.tensor([0, 0, 1, 1], dtype=torch.bool)
    adv, _ = gae_packed(torch.tensor([3.0, 2.0]), torch.tensor([0, 2, 4]), gamma=0.9, lam=0.9,
                        loss_mask_T=mask)
    assert adv.tolist() == pytest.approx([0, 0, 2 * 0.81, 2.0])
