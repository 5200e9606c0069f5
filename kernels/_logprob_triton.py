"""Triton kernels behind ``logprob.logprob_entropy_triton`` (math in ``logprob``'s docstring).

Shape legend: T = tokens, V = this TP rank's vocab shard; a program's tile is BLOCK_T x BLOCK_V.

The forward is one program per BLOCK_T tokens streaming over their rows BLOCK_V columns
at a time with an online max (flash-attention style rescaling of S and D when the max
grows), so nothing ``[T, V]``-sized is allocated. The backward is one program per
(BLOCK_T tokens, BLOCK_V columns) tile and writes the logits' gradient in their dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from areal_mcore.kernels import check_runnable
from areal_mcore.kernels.logprob import NEG_BIG

# Tile of one program: BLOCK_T tokens x BLOCK_V columns per step. Module values, not
# arguments, so both paths keep one signature; tests lower BLOCK_V to cover several column
# blocks (and a ragged last one) at small V. Untuned guesses for GPUs: 8k fp32 per step.
BLOCK_T = 4
BLOCK_V = 2048
_NEG = tl.constexpr(NEG_BIG)


@triton.jit
def _partials_kernel(logits_ptr, stride_t, targets_ptr, out_ptr, T, V, start, vocab_size,
                     temperature, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    # int64 offsets: row * stride_t overflows int32 at 16k tokens x 152k columns.
    base = logits_ptr + rows.to(tl.int64)[:, None] * stride_t
    # Local column of each target; one outside this shard's real columns matches none.
    target = tl.load(targets_ptr + rows, mask=row_ok, other=-1) - start
    n_real = vocab_size - start  # columns from here on are vocab padding
    m = tl.full([BLOCK_T], _NEG, tl.float32)
    s = tl.zeros([BLOCK_T], tl.float32)
    d = tl.zeros([BLOCK_T], tl.float32)
    zt = tl.zeros([BLOCK_T], tl.float32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        real = row_ok[:, None] & ((cols < V) & (cols < n_real))[None, :]
        z = tl.load(base + cols[None, :], mask=real, other=0.0).to(tl.float32) / temperature
        z = tl.where(real, z, _NEG)  # exp(z - m) stays finite on masked columns
        m_new = tl.maximum(m, tl.max(z, axis=1))
        alpha = tl.exp(m - m_new)
        z_shift = z - m_new[:, None]
        e = tl.where(real, tl.exp(z_shift), 0.0)
        # D' = Σ e'(z - m') = alpha (D + (m - m') S) + this block's terms
        d = alpha * (d + (m - m_new) * s) + tl.sum(e * z_shift, axis=1)
        s = alpha * s + tl.sum(e, axis=1)
        zt += tl.sum(tl.where(real & (cols[None, :] == target[:, None]), z, 0.0), axis=1)
        m = m_new
    tl.store(out_ptr + rows, m, mask=row_ok)
    tl.store(out_ptr + T + rows, s, mask=row_ok)
    tl.store(out_ptr + 2 * T + rows, d, mask=row_ok)
    tl.store(out_ptr + 3 * T + rows, zt, mask=row_ok)


@triton.jit
def _grad_kernel(logits_ptr, stride_t, grad_ptr, stride_gt, targets_ptr, lse_ptr, mean_z_ptr,
                 g_logp_ptr, g_ent_ptr, T, V, start, vocab_size, temperature,
                 HAS_LOGP: tl.constexpr, HAS_ENT: tl.constexpr,
                 BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = rows < T
    in_tile = row_ok[:, None] & (cols < V)[None, :]
    real = in_tile & (cols < vocab_size - start)[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    z = tl.load(logits_ptr + rows64 * stride_t + cols[None, :], mask=real, other=0.0)
    z = z.to(tl.float32) / temperature
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    p = tl.exp(tl.where(real, z - lse[:, None], _NEG))  # 0 on padding and outside the tile
    g = tl.zeros([BLOCK_T, BLOCK_V], tl.float32)
    if HAS_ENT:  # dH/dz = -p (z - E)
        g_ent = tl.load(g_ent_ptr + rows, mask=row_ok, other=0.0)
        mean_z = tl.load(mean_z_ptr + rows, mask=row_ok, other=0.0)
        g -= g_ent[:, None] * p * (z - mean_z[:, None])
    if HAS_LOGP:  # dlogp/dz = onehot - p
        target = tl.load(targets_ptr + rows, mask=row_ok, other=-1) - start
        g_logp = tl.load(g_logp_ptr + rows, mask=row_ok, other=0.0)
        onehot = tl.where(real & (cols[None, :] == target[:, None]), 1.0, 0.0)
        g += g_logp[:, None] * (onehot - p)
    out = (g / temperature).to(grad_ptr.dtype.element_ty)
    tl.store(grad_ptr + rows64 * stride_gt + cols[None, :], out, mask=in_tile)


def _block(V: int) -> int:
    return min(BLOCK_V, triton.next_power_of_2(V))


def partials(logits_TV, targets_T, *, start, vocab_size, temperature, chunk_tokens):
    """(m, S, D, z_t) of each row over this shard, float32 ``[T]`` each."""
    check_runnable(_partials_kernel, logits_TV.device, "logprob_kernel")
    T, V = logits_TV.shape
    out_4T = torch.empty(4, T, dtype=torch.float32, device=logits_TV.device)
    if T:
        _partials_kernel[(triton.cdiv(T, BLOCK_T),)](
            logits_TV, logits_TV.stride(0), targets_T, out_4T, T, V, start, vocab_size,
            float(temperature), BLOCK_T=BLOCK_T, BLOCK_V=_block(V), num_warps=8)
    return out_4T.unbind(0)


def grad(logits_TV, targets_T, lse_T, mean_z_T, g_logp_T, g_ent_T, *, start, vocab_size,
         temperature, chunk_tokens):
    """d(Σ g_logp·logp + g_ent·H)/d logits_TV, in the logits' dtype."""
    T, V = logits_TV.shape
    grad_TV = torch.empty_like(logits_TV)
    # A None gradient still needs a pointer; the constexpr flags keep it unread.
    g_logp = lse_T if g_logp_T is None else g_logp_T.float().contiguous()
    g_ent = lse_T if g_ent_T is None else g_ent_T.float().contiguous()
    if T:
        block = _block(V)
        _grad_kernel[(triton.cdiv(T, BLOCK_T), triton.cdiv(V, block))](
            logits_TV, logits_TV.stride(0), grad_TV, grad_TV.stride(0), targets_T, lse_T, mean_z_T,
            g_logp, g_ent, T, V, start, vocab_size, float(temperature),
            HAS_LOGP=g_logp_T is not None, HAS_ENT=g_ent_T is not None,
            BLOCK_T=BLOCK_T, BLOCK_V=block, num_warps=8)
    return grad_TV
