"""GAE over THD-packed sequences.

Shape legend: B = sequences, T = packed tokens, B1 = B + 1, A = action tokens (mask on).

Only tokens with ``loss_mask`` on are actions (the generated response); the scan skips
the others, so a masked span inside a sequence neither receives an advantage nor breaks
the recursion. The sequence's scalar reward sits on its last action token, plus optional
per-token rewards on every action token (the KL penalty of ``ppo.kl_in: reward``). With no
values (critic-free, boba) and γ = λ = 1, every action token gets its sequence reward.
``kernel`` picks the Triton kernel (``kernels/gae.py``, one program per sequence) or this
vectorised torch path; both give the same numbers. The Triton kernel takes sequence
rewards only: per-token rewards run the torch path (GAE is a negligible share of a step).
"""

from __future__ import annotations

import torch

from areal_mcore.kernels import use_triton


def gae_packed(
    rewards_B: torch.Tensor,
    cu_seqlens_B1: torch.Tensor,
    *,
    gamma: float,
    lam: float,
    values_T: torch.Tensor | None = None,
    loss_mask_T: torch.Tensor | None = None,
    token_rewards_T: torch.Tensor | None = None,
    kernel: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns per token; zero on tokens that are not actions.

    Args:
        rewards_B: scalar reward of each sequence.
        cu_seqlens_B1: sequence boundaries in the packed layout (padding included).
        gamma, lam: discount and GAE λ.
        values_T: critic values per token; None means 0 (no critic).
        loss_mask_T: action tokens; None means every token.
        token_rewards_T: rewards added at each action token (others ignored); None: none.
        kernel: ``PPOConfig.gae_kernel``: "auto" (Triton with CUDA), "triton" or "torch".

    Returns:
        (advantages_T, returns_T), float32, on the device of ``rewards_B``;
        returns = advantages + values.
    """
    if token_rewards_T is None and use_triton(kernel, "gae_kernel"):
        from areal_mcore.kernels.gae import gae_packed_triton

        return gae_packed_triton(rewards_B, cu_seqlens_B1, gamma=gamma, lam=lam,
                                 values_T=values_T, loss_mask_T=loss_mask_T)
    cu = cu_seqlens_B1.long()
    T, B = int(cu[-1]), cu.numel() - 1
    device = rewards_B.device
    seq_T = torch.repeat_interleave(torch.arange(B, device=device), cu[1:] - cu[:-1])
    act = torch.ones(T, dtype=torch.bool, device=device) if loss_mask_T is None else loss_mask_T.bool()
    idx_A = act.nonzero().squeeze(1)
    seq_A = seq_T[idx_A]
    n_A = len(idx_A)
    # Compressed action sequences: ends of each sequence's run in idx_A order.
    counts_B = torch.bincount(seq_A, minlength=B)
    ends_B = torch.cumsum(counts_B, 0) - 1  # index of each sequence's last action
    has_B = counts_B > 0

    r_A = torch.zeros(n_A, dtype=torch.float64, device=device)
    r_A[ends_B[has_B]] = rewards_B.double()[has_B]
    if token_rewards_T is not None:
        r_A += token_rewards_T.double()[idx_A]
    v_A = torch.zeros_like(r_A) if values_T is None else values_T.double()[idx_A]
    last_A = torch.zeros(n_A, dtype=torch.bool, device=device)
    last_A[ends_B[has_B]] = True
    v_next_A = torch.where(last_A, 0.0, torch.roll(v_A, -1)) if n_A else v_A
    delta_A = r_A + gamma * v_next_A - v_A

    c = gamma * lam
    if c == 1.0:  # suffix sums within each sequence, from one global cumsum
        csum_A = torch.cumsum(delta_A, 0)
        adv_A = csum_A[ends_B[seq_A]] - csum_A + delta_A
    else:
        adv_A = _discounted_suffix_sums(delta_A, counts_B, c)

    adv_T = torch.zeros(T, dtype=torch.float32, device=device)
    adv_T[idx_A] = adv_A.float()
    ret_T = torch.zeros_like(adv_T)
    ret_T[idx_A] = (adv_A + v_A).float()
    return adv_T, ret_T


def _discounted_suffix_sums(x_A: torch.Tensor, counts_B: torch.Tensor, c: float) -> torch.Tensor:
    """y_t = x_t + c·y_{t+1} within each run; one vectorised step per position."""
    B, L = counts_B.numel(), int(counts_B.max()) if counts_B.numel() else 0
    pos_A = torch.arange(x_A.numel(), device=x_A.device) - torch.repeat_interleave(
        torch.cumsum(counts_B, 0) - counts_B, counts_B
    )
    seq_A = torch.repeat_interleave(torch.arange(B, device=x_A.device), counts_B)
    grid_BL = torch.zeros(B, L + 1, dtype=x_A.dtype, device=x_A.device)
    grid_BL[seq_A, pos_A] = x_A
    for t in range(L - 1, -1, -1):  # the zero column L ends every run
        grid_BL[:, t] += c * grid_BL[:, t + 1]
    return grid_BL[seq_A, pos_A]
