import pytest
import torch

from areal_mcore.algo import normalize, transform_reward


def test_boba_reward_transform_maps_correctness_to_plus_minus_five():
    out = transform_reward(torch.tensor([1.0, 0.0]), bias=-0.5, scaling=10.0, clip=20.0)
    assert out.tolist() == [5.0, -5.0]
    assert transform_reward(torch.tensor([9.0]), bias=0.0, scaling=10.0, clip=20.0).tolist() == [20.0]


def test_group_normalisation_uses_contiguous_groups():
    x = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    out = normalize(x, mean_level="group", std_level="group", group_size=4, eps=1e-12)
    g0 = (x[:4] - 0.25) / x[:4].std(unbiased=False)
    torch.testing.assert_close(out[:4], g0)
    assert out[4:].abs().max() == 0  # all-equal group: centred to 0, std 0 -> stays 0


def test_unbiased_std_option():
    x = torch.tensor([1.0, 2.0, 3.0, 6.0])
    biased = normalize(x, mean_level="batch", std_level="batch", eps=0.0)
    unbiased = normalize(x, mean_level="batch", std_level="batch", unbiased_std=True, eps=0.0)
    torch.testing.assert_close(biased, (x - 3) / x.std(unbiased=False))
    torch.testing.assert_close(unbiased, (x - 3) / x.std(unbiased=True))


def test_batch_normalisation_is_token_weighted_over_masked_tokens():
    x = torch.tensor([10.0, 1.0, 2.0, 3.0, 100.0])
    mask = torch.tensor([0, 1, 1, 1, 0], dtype=torch.bool)
    out = normalize(x, mean_level="batch", std_level="batch", eps=0.0, mask=mask)
    kept = torch.tensor([1.0, 2.0, 3.0])
    torch.testing.assert_close(out[1:4], (kept - 2) / kept.std(unbiased=False))
    assert out[0] == 0 and out[4] == 0


def test_mean_group_std_none_only_centres():
    x = torch.tensor([1.0, 3.0, 10.0, 20.0])
    out = normalize(x, mean_level="group", std_level="none", group_size=2)
    assert out.tolist() == [-1.0, 1.0, -5.0, 5.0]


@pytest.mark.parametrize("kw, match", [
    (dict(mean_level="group", std_level="none", group_size=3), "multiple of group_size=3"),
    (dict(mean_level="prompt", std_level="none"), "mean_level='prompt'"),
])
def test_bad_normalisation_arguments_are_named(kw, match):
    with pytest.raises(ValueError, match=match):
        normalize(torch.ones(4), **kw)
