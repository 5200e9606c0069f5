"""Fused token logprob + entropy over vocab-parallel logits, forward and backward.

Shape legend: T = tokens, V = this TP rank's shard of the padded vocab, C = chunk rows.

With z = logits / τ over the whole (sharded) vocabulary and t the target id:
    m = max z,  S = Σ exp(z − m),  lse = m + log S,  logp = z_t − lse,
    D = Σ exp(z − m)(z − m),  E = Σ p z = m + D/S,  H = lse − E = log S − D/S.
Each rank computes (m, S, D, z_t) over its own shard, streaming over the vocabulary; one
MAX and one SUM all-reduce over the TP group combine them (megatron's
``vocab_parallel_cross_entropy`` does the same with three). D is kept relative to the max
so that H comes without the cancellation of lse − E. The backward needs no
communication given the global lse and E:
    ∂logp/∂z_j = 1[j = t] − p_j,   ∂H/∂z_j = −p_j (z_j − E),   ∂/∂logits = ∂/∂z / τ.
Rows of the padded vocabulary (ids ≥ ``vocab_size``) are not real tokens: they take no
probability mass and get no gradient. A target outside this shard's real columns
contributes 0 to z_t here (one in the padding is not a token: its logp is -lse, where
megatron's gives -inf). Logits may be bf16; everything accumulates in fp32.

Two paths with the same signature and numbers: the Triton kernels (``_logprob_triton``,
programs of a few tokens streaming over V, nothing ``[T, V]``-sized but the gradient) and
a pure-torch reference that materialises two fp32 ``[chunk_tokens, V]`` blocks at a time,
chunking over T to bound memory. ``logprob_entropy`` chooses between them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from areal_mcore import collectives
from areal_mcore.kernels import use_triton

# A finite stand-in for -inf as the running max: a shard whose rows are all padding then
# gives S = D = 0 instead of NaNs from (-inf) - (-inf) in the rescaling.
NEG_BIG = -1e30


def logprob_entropy(logits_TV: torch.Tensor, targets_T: torch.Tensor, *, vocab_size: int,
                    tp_rank: int = 0, tp_group: dist.ProcessGroup | None = None,
                    temperature: float = 1.0, chunk_tokens: int = 1024,
                    kernel: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """log p(target) and the entropy of every row of vocab-parallel logits.

    Args:
        logits_TV: this rank's vocab shard of the logits (any float dtype).
        targets_T: the token id each row predicts (global ids).
        vocab_size: the real vocabulary size; ids at or past it are padding.
        tp_rank: this rank's index in ``tp_group``; the shard starts at ``tp_rank * V``.
        tp_group: the tensor-parallel group the vocabulary is split over; None for one shard.
        temperature: logits are divided by it before the softmax.
        chunk_tokens: rows per fp32 block on the torch path (memory is O(chunk_tokens · V)).
        kernel: "auto" (Triton with CUDA), "triton" or "torch" (``KERNEL_CHOICES``).

    Returns:
        (logp_T, entropy_T), float32, both differentiable with respect to ``logits_TV``.
    """
    fn = logprob_entropy_triton if use_triton(kernel, "logprob_kernel") else logprob_entropy_torch
    return fn(logits_TV, targets_T, vocab_size=vocab_size, tp_rank=tp_rank, tp_group=tp_group,
              temperature=temperature, chunk_tokens=chunk_tokens)


def logprob_entropy_torch(logits_TV, targets_T, *, vocab_size, tp_rank=0, tp_group=None,
                          temperature=1.0, chunk_tokens=1024):
    """The pure-torch path of ``logprob_entropy`` (same arguments and results)."""
    return _LogprobEntropy.apply(logits_TV, targets_T, vocab_size, tp_rank, tp_group,
                                 temperature, chunk_tokens, False)


def logprob_entropy_triton(logits_TV, targets_T, *, vocab_size, tp_rank=0, tp_group=None,
                           temperature=1.0, chunk_tokens=1024):
    """The Triton path of ``logprob_entropy`` (same arguments and results; needs CUDA
    tensors, or CPU tensors under ``TRITON_INTERPRET=1``). ``chunk_tokens`` is unused:
    the kernels stream over V and hold no ``[T, V]`` temporaries."""
    return _LogprobEntropy.apply(logits_TV, targets_T, vocab_size, tp_rank, tp_group,
                                 temperature, chunk_tokens, True)


class _LogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_TV, targets_T, vocab_size, tp_rank, tp_group, temperature,
                chunk_tokens, triton_path):
        if logits_TV.stride(-1) != 1:
            logits_TV = logits_TV.contiguous()
        targets_T = targets_T.to(device=logits_TV.device, dtype=torch.int64).contiguous()
        start = tp_rank * logits_TV.shape[-1]
        if triton_path:
            from areal_mcore.kernels import _logprob_triton as impl
        else:
            impl = _TorchPath
        m_T, s_T, d_T, zt_T = impl.partials(logits_TV, targets_T, start=start, vocab_size=vocab_size,
                                            temperature=temperature, chunk_tokens=chunk_tokens)
        m_T, s_T, d_T, zt_T = _combine_shards(m_T, s_T, d_T, zt_T, tp_group)
        log_s_T = torch.log(s_T)
        lse_T = m_T + log_s_T
        mean_z_T = m_T + d_T / s_T  # E, the expected z under p
        ctx.save_for_backward(logits_TV, targets_T, lse_T, mean_z_T)
        ctx.impl, ctx.start, ctx.vocab_size = impl, start, vocab_size
        ctx.temperature, ctx.chunk_tokens = temperature, chunk_tokens
        ctx.set_materialize_grads(False)  # an unused entropy skips its term in backward
        return zt_T - lse_T, log_s_T - d_T / s_T

    @staticmethod
    def backward(ctx, g_logp_T, g_ent_T):
        grad_TV = None
        if ctx.needs_input_grad[0] and (g_logp_T is not None or g_ent_T is not None):
            logits_TV, targets_T, lse_T, mean_z_T = ctx.saved_tensors
            grad_TV = ctx.impl.grad(logits_TV, targets_T, lse_T, mean_z_T, g_logp_T, g_ent_T,
                                    start=ctx.start, vocab_size=ctx.vocab_size,
                                    temperature=ctx.temperature, chunk_tokens=ctx.chunk_tokens)
        return grad_TV, None, None, None, None, None, None, None


def _combine_shards(m_T, s_T, d_T, zt_T, group):
    """(m, S, D, z_t) of the whole vocabulary from each rank's shard statistics."""
    if group is None or dist.get_world_size(group) == 1:
        return m_T, s_T, d_T, zt_T
    max_T = m_T.clone()
    collectives.all_reduce(max_T, group, op=dist.ReduceOp.MAX)
    # Rescale to the global max: exp(z - M) = exp(z - m) exp(m - M), z - M = (z - m) + (m - M).
    scale_T = torch.exp(m_T - max_T)
    sums_3T = torch.stack([scale_T * s_T, scale_T * (d_T + (m_T - max_T) * s_T), zt_T])
    collectives.all_reduce(sums_3T, group)
    s_T, d_T, zt_T = sums_3T.unbind(0)
    return max_T, s_T, d_T, zt_T


class _TorchPath:
    """The torch path's ``partials`` and ``grad``, the same two functions as the module
    ``_logprob_triton``. The padded vocab is a tail of columns, so this path slices it off
    instead of masking; in-place ops keep two fp32 [C, V] blocks alive at a time."""

    @staticmethod
    def partials(logits_TV, targets_T, *, start, vocab_size, temperature, chunk_tokens):
        T, V = logits_TV.shape
        n_real = min(max(vocab_size - start, 0), V)
        local_T = targets_T - start
        hit_T = (local_T >= 0) & (local_T < n_real)  # target is a real column of this shard
        local_T = local_T.clamp(0, V - 1)
        out_4T = torch.zeros(4, T, dtype=torch.float32, device=logits_TV.device)
        out_4T[0] = NEG_BIG  # an all-padding shard: S = D = z_t = 0
        for c in range(0, T if n_real else 0, chunk_tokens):
            rows = slice(c, c + chunk_tokens)
            z_CV = logits_TV[rows, :n_real].to(torch.float32, copy=True).div_(temperature)
            m_C1 = z_CV.amax(-1, keepdim=True)
            z_CV -= m_C1  # z - m from here on
            e_CV = torch.exp(z_CV)
            out_4T[0, rows] = m_C1.squeeze(1)
            out_4T[1, rows] = e_CV.sum(-1)
            out_4T[2, rows] = e_CV.mul_(z_CV).sum(-1)  # Σ e (z - m), in e's block
            zt_C = logits_TV[rows].gather(1, local_T[rows, None]).squeeze(1).float() / temperature
            out_4T[3, rows] = torch.where(hit_T[rows], zt_C, 0.0)
            del z_CV, e_CV  # before the next chunk allocates its blocks
        return out_4T.unbind(0)

    @staticmethod
    def grad(logits_TV, targets_T, lse_T, mean_z_T, g_logp_T, g_ent_T, *, start, vocab_size,
             temperature, chunk_tokens):
        T, V = logits_TV.shape
        n_real = min(max(vocab_size - start, 0), V)
        local_T = targets_T - start
        hit_T = (local_T >= 0) & (local_T < n_real)
        local_T = local_T.clamp(0, max(n_real - 1, 0))
        grad_TV = torch.empty_like(logits_TV)
        grad_TV[:, n_real:] = 0  # padding takes no probability mass
        for c in range(0, T if n_real else 0, chunk_tokens):
            rows = slice(c, c + chunk_tokens)
            z_CV = logits_TV[rows, :n_real].to(torch.float32, copy=True).div_(temperature)
            p_CV = torch.sub(z_CV, lse_T[rows, None]).exp_()
            if g_ent_T is not None:  # -g_H p (z - E), in z's block
                g_CV = z_CV.sub_(mean_z_T[rows, None]).mul_(p_CV).mul_(-g_ent_T[rows, None])
                if g_logp_T is not None:  # - g_logp p
                    g_CV.addcmul_(p_CV, g_logp_T[rows, None], value=-1.0)
            else:
                g_CV = p_CV.mul_(-g_logp_T[rows, None])
            if g_logp_T is not None:  # + g_logp onehot
                hit_C = torch.where(hit_T[rows], g_logp_T[rows], 0.0)
                g_CV.scatter_add_(1, local_T[rows, None], hit_C[:, None])
            grad_TV[rows, :n_real] = g_CV.div_(temperature)
            del z_CV, p_CV, g_CV  # before the next chunk allocates its blocks
        return grad_TV
