"""A plain-Python GAE loop and random packed batches: the reference both GAE paths
(algo/gae.py and kernels/gae.py) are tested against."""

import torch


def reference_gae(rewards, lengths, values, mask, gamma, lam, token_rewards=None):
    """Plain Python loop, one sequence at a time, over its action tokens in reverse;
    ``token_rewards``: a reward on every action token besides the sequence's last one."""
    adv = [0.0] * sum(lengths)
    ret = [0.0] * sum(lengths)
    start = 0
    for b, n in enumerate(lengths):
        actions = [t for t in range(start, start + n) if mask[t]]
        last_gae, next_value = 0.0, 0.0
        for j, t in enumerate(reversed(actions)):
            r = (rewards[b] if j == 0 else 0.0) + (float(token_rewards[t]) if token_rewards is not None else 0.0)
            v = values[t] if values is not None else 0.0
            delta = r + gamma * next_value - v
            last_gae = delta + gamma * lam * last_gae
            adv[t], ret[t] = last_gae, last_gae + v
            next_value = v
        start += n
    return torch.tensor(adv), torch.tensor(ret)


def random_packed(seed, with_values, masked):
    g = torch.Generator().manual_seed(seed)
    B = int(torch.randint(1, 9, (1,), generator=g))
    lengths = torch.randint(1, 30, (B,), generator=g).tolist()
    T = sum(lengths)
    rewards = torch.randn(B, generator=g)
    values = torch.randn(T, generator=g) if with_values else None
    mask = (torch.rand(T, generator=g) > 0.3) if masked else torch.ones(T, dtype=torch.bool)
    cu = torch.tensor([0] + torch.cumsum(torch.tensor(lengths), 0).tolist(), dtype=torch.int32)
    return rewards, lengths, cu, values, mask
