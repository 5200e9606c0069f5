import pytest
import torch
from _gae_reference import random_packed, reference_gae

from areal_mcore.algo import gae_packed


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.99, 0.95), (1.0, 0.9), (0.5, 1.0), (0.0, 0.3)])
@pytest.mark.parametrize("with_values", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_gae_matches_python_reference_on_random_packed_batches(gamma, lam, with_values, masked):
    for seed in range(10):
        rewards, lengths, cu, values, mask = random_packed(seed, with_values, masked)
        adv, ret = gae_packed(rewards, cu, gamma=gamma, lam=lam, values_T=values,
                              loss_mask_T=mask if masked else None, kernel="torch")
        ref_adv, ref_ret = reference_gae(rewards.tolist(), lengths,
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
