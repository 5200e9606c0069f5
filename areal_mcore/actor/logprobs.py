"""Per-token logprobs (and entropies) from vocab-parallel logits, aligned with the packed
tokens.

Shape legend: T = packed tokens, V = this TP rank's slice of the padded vocab.

Logits at position t predict token t + 1. The results are aligned with the tokens
themselves: ``logp_T[t] = log p(input_ids[t] | input_ids[<t])``, ``entropy_T[t]`` is the
entropy of that same distribution, and both are 0 at the first token of each sequence,
the same convention as rollout logprobs. ``kernels.logprob`` reduces max / sum-exp /
target logit over the TP group like megatron's ``vocab_parallel_cross_entropy``, so the
full vocabulary is never gathered on one rank, and masks the padded vocab rows: they are
not real tokens and must not take probability mass.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from areal_mcore.kernels.logprob import logprob_entropy


def token_logprobs_entropy(logits_TV: torch.Tensor, input_ids_T: torch.Tensor,
                           cu_seqlens_B1: torch.Tensor, *, vocab_size: int, tp_rank: int,
                           tp_group: dist.ProcessGroup | None, temperature: float = 1.0,
                           kernel: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """(logp_T, entropy_T) of every token given its prefix; differentiable through
    ``logits_TV``. ``kernel`` is ``ActorConfig.logprob_kernel`` (auto|triton|torch)."""
    assert tp_group is not None or tp_rank == 0, "a vocab shard past the first needs its TP group"
    targets_T = torch.roll(input_ids_T, -1)
    next_T, ent_T = logprob_entropy(logits_TV, targets_T, vocab_size=vocab_size, tp_rank=tp_rank,
                                    tp_group=tp_group, temperature=temperature, kernel=kernel)
    return token_aligned(next_T, cu_seqlens_B1), token_aligned(ent_T, cu_seqlens_B1)


def token_aligned(next_T: torch.Tensor, cu_seqlens_B1: torch.Tensor) -> torch.Tensor:
    """Values of the position that predicts each token (``next_T[t]`` scores token t + 1)
    moved onto that token: ``out[t] = next_T[t - 1]``, 0 at each sequence's first token."""
    return torch.roll(next_T, 1).index_fill(0, cu_seqlens_B1[:-1].long(), 0.0)


def token_logprobs(logits_TV: torch.Tensor, input_ids_T: torch.Tensor, cu_seqlens_B1: torch.Tensor,
                   *, vocab_size: int, tp_rank: int, tp_group: dist.ProcessGroup | None,
                   temperature: float = 1.0, kernel: str = "auto") -> torch.Tensor:
    """log p of every token given its prefix (``token_logprobs_entropy`` without the
    entropy, whose backward term is then skipped)."""
    return token_logprobs_entropy(logits_TV, input_ids_T, cu_seqlens_B1, vocab_size=vocab_size,
                                  tp_rank=tp_rank, tp_group=tp_group, temperature=temperature,
                                  kernel=kernel)[0]
