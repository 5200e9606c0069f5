"""GAE over THD-packed sequences in Triton: one program per sequence, a reverse scan.

Shape legend: B = sequences, T = packed tokens, B1 = B + 1.

Same semantics and signature as ``areal_mcore.algo.gae.gae_packed`` (the torch path,
which dispatches here): only tokens with ``loss_mask`` on are actions; the scan skips the
others without breaking the recursion; the sequence's reward sits on its last action
token; returns = advantages + values; tokens that are not actions get 0. The recursion
runs in float64 like the torch path, so long sequences with a critic do not drift.

The scan is sequential within a sequence (one token per step, loads independent of the
carry) and parallel across sequences; GAE is a negligible share of an RL step either way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from areal_mcore.kernels import check_runnable


@triton.jit
def _gae_kernel(rewards_ptr, cu_ptr, values_ptr, mask_ptr, adv_ptr, ret_ptr, coef_ptr,
                HAS_VALUES: tl.constexpr, HAS_MASK: tl.constexpr):
    b = tl.program_id(0)
    gamma = tl.load(coef_ptr)  # float64 from memory: a float argument would be rounded to fp32
    gamma_lam = tl.load(coef_ptr + 1)
    start = tl.load(cu_ptr + b)
    end = tl.load(cu_ptr + b + 1)
    reward = tl.load(rewards_ptr + b).to(tl.float64)
    gae = tl.zeros([], tl.float64)
    next_value = tl.zeros([], tl.float64)
    seen = tl.zeros([], tl.int1)  # an action token after t was already scanned
    for i in range(end - start):
        t = end - 1 - i
        act = tl.full([], 1, tl.int1)
        if HAS_MASK:
            act = tl.load(mask_ptr + t) != 0
        value = tl.zeros([], tl.float64)
        if HAS_VALUES:
            value = tl.load(values_ptr + t).to(tl.float64)
        delta = tl.where(seen, 0.0, reward) + gamma * next_value - value
        step = delta + gamma_lam * gae
        gae = tl.where(act, step, gae)
        next_value = tl.where(act, value, next_value)
        seen = seen | act
        tl.store(adv_ptr + t, tl.where(act, step, 0.0).to(tl.float32))
        tl.store(ret_ptr + t, tl.where(act, step + value, 0.0).to(tl.float32))


def gae_packed_triton(
    rewards_B: torch.Tensor,
    cu_seqlens_B1: torch.Tensor,
    *,
    gamma: float,
    lam: float,
    values_T: torch.Tensor | None = None,
    loss_mask_T: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns per token, float32, on the device of ``rewards_B``.

    Args and returns as ``areal_mcore.algo.gae.gae_packed``. CPU inputs run on the
    current CUDA device when there is one (the trainer packs batches on the host) and
    come back to the host; without CUDA they need Triton's interpreter.
    """
    home = rewards_B.device
    device = torch.device("cuda") if home.type == "cpu" and torch.cuda.is_available() else home
    check_runnable(_gae_kernel, device, "gae_kernel")
    cu = cu_seqlens_B1.to(device=device, dtype=torch.int64).contiguous()
    B, T = cu.numel() - 1, int(cu_seqlens_B1[-1])
    adv_T = torch.zeros(T, dtype=torch.float32, device=device)
    ret_T = torch.zeros_like(adv_T)
    if B > 0 and T > 0:
        rewards = rewards_B.to(device=device, dtype=torch.float32).contiguous()
        # Unused pointers still need a tensor; the constexpr flags keep them unread.
        values = adv_T if values_T is None else values_T.to(device).contiguous()
        mask = adv_T if loss_mask_T is None else loss_mask_T.to(device=device, dtype=torch.int8).contiguous()
        coef = torch.tensor([gamma, gamma * lam], dtype=torch.float64, device=device)
        _gae_kernel[(B,)](rewards, cu, values, mask, adv_T, ret_T, coef,
                          HAS_VALUES=values_T is not None, HAS_MASK=loss_mask_T is not None)
    return adv_T.to(home), ret_T.to(home)
