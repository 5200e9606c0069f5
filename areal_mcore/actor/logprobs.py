"""Per-token logprobs from vocab-parallel logits, aligned with the packed tokens.

Shape legend: T = packed tokens, V = this TP rank's slice of the padded vocab.

Logits at position t predict token t + 1. The result is aligned with the tokens
themselves: ``logp_T[t] = log p(input_ids[t] | input_ids[<t])`` and 0 at the first token
of each sequence, the same convention as rollout logprobs. megatron's
``vocab_parallel_cross_entropy`` reduces max / sum-exp / target logit over the TP group,
so the full vocabulary is never gathered on one rank. Padded vocab rows are masked to
-inf: they are not real tokens and must not take probability mass.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy


def token_logprobs(logits_TV: torch.Tensor, input_ids_T: torch.Tensor, cu_seqlens_B1: torch.Tensor,
                   *, vocab_size: int, tp_rank: int, temperature: float = 1.0) -> torch.Tensor:
    """log p of every token given its prefix; differentiable through ``logits_TV``."""
    V = logits_TV.shape[-1]
    start = tp_rank * V
    logits = logits_TV.float()
    if temperature != 1.0:
        logits = logits / temperature
    if start + V > vocab_size:  # this rank holds (part of) the vocab padding
        pad = torch.arange(start, start + V, device=logits.device) >= vocab_size
        logits = logits.masked_fill(pad, float("-inf"))
    targets_T = torch.roll(input_ids_T, -1)
    # megatron wants [s, b, v] logits and [s, b] targets; b = 1 for a THD row.
    next_T = -vocab_parallel_cross_entropy(logits.unsqueeze(1), targets_T.unsqueeze(1)).squeeze(1)
    logp_T = torch.roll(next_T, 1)
    starts = cu_seqlens_B1[:-1].long()
    return logp_T.index_fill(0, starts, 0.0)
