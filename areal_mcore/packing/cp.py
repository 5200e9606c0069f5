"""Context parallelism's view of a THD batch: which tokens of the packed row a CP rank holds.

Shape legend: T = packed tokens of the whole row, t = this CP rank's tokens (T / cp),
B1 = sequences + 1.

Causal attention makes a sequence's late tokens costlier than its early ones, so a
sequence is cut into 2·cp equal chunks and CP rank r keeps chunks r and 2·cp−1−r: every
rank gets one cheap and one dear chunk. This is the layout megatron-core's THD RoPE reads
(models/common/embeddings/rope_utils.py, ``_get_thd_freqs_on_this_cp_rank``: each
sequence's local half ``[r·c, (r+1)·c)`` then ``[L−(r+1)·c, L−r·c)``) and TE's
``thd_get_partitioned_indices`` produces; the rank's sequences stay in batch order, so
megatron's ``PackedSeqParams`` keep the whole row's cu_seqlens (RoPE divides them by cp).
Each segment of the layout must therefore be a multiple of 2·cp tokens.

The next-token target of a chunk's last token lives in another chunk, so whatever pairs a
position with the *next* token (labels, and the fields the loss weighs a prediction by) is
shifted along the whole sequence before the split (``shift_left``), never after it. The
index tensors of a layout are built once and kept (``cp_token_index``): a micro-batch's
forward needs them in the embedding, in every attention layer and in the loss.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from itertools import accumulate

import torch
import torch.distributed as dist

from areal_mcore import collectives
from areal_mcore.packing.thd import PackedBatch, _cumsum, to_device


def check_cp_layout(seqlens_padded: Sequence[int], cp_size: int) -> None:
    """Raises unless every segment splits into 2·cp equal chunks (any layout at cp=1)."""
    if cp_size == 1:
        return
    bad = [(i, n) for i, n in enumerate(seqlens_padded) if n % (2 * cp_size)]
    if bad:
        i, n = bad[0]
        raise ValueError(f"context parallelism cp={cp_size} cuts each sequence into {2 * cp_size} equal "
                         f"chunks, but segment {i} is {n} tokens ({len(bad)} such segment(s)); pack with "
                         f"pad_to_multiple_of a multiple of {2 * cp_size}")


def cp_token_index(seqlens_padded: Sequence[int], cp_size: int, cp_rank: int,
                   device: torch.device | None = None) -> torch.Tensor:
    """Positions in the packed row of CP rank ``cp_rank``'s tokens, in its local order
    (per sequence: chunk r, then chunk 2·cp−1−r). At cp=1 every position, in order.

    On ``device`` (default: the host), built once per layout: a micro-batch's forward asks
    for it in the embedding, in every attention layer and in the loss, so it is kept (a
    few recent layouts; read-only: never write into it)."""
    check_cp_layout(seqlens_padded, cp_size)
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} is outside [0, {cp_size})")
    return _token_index(tuple(seqlens_padded), cp_size, cp_rank, device)


def cp_gather_order(seqlens_padded: Sequence[int], cp_size: int,
                    device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, inverse): the packed-row positions of the CP ranks' tokens concatenated in
    rank order (what an all-gather over the CP group returns), and the permutation that
    puts such a gather back in the row's order. Kept per layout, like ``cp_token_index``."""
    check_cp_layout(seqlens_padded, cp_size)
    return _gather_order(tuple(seqlens_padded), cp_size, device)


# A micro-batch's layouts live for its forward and backward; 16 covers a 1F1B window of
# micro-batches on a pipeline stage, a few MB of int64 on the GPU at 32k-token micro-batches.
@functools.lru_cache(maxsize=16)
def _token_index(seqlens: tuple[int, ...], cp_size: int, cp_rank: int, device) -> torch.Tensor:
    parts = []
    for start, n in zip(accumulate(seqlens[:-1], initial=0), seqlens):
        c = n // (2 * cp_size)
        for k in (cp_rank, 2 * cp_size - 1 - cp_rank) if cp_size > 1 else (0,):
            parts.append(torch.arange(start + k * c, start + (k + 1) * c if cp_size > 1 else start + n))
    index = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)
    return to_device(index, device) if device is not None else index


@functools.lru_cache(maxsize=16)
def _gather_order(seqlens: tuple[int, ...], cp_size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    order = torch.cat([_token_index(seqlens, cp_size, r, None) for r in range(cp_size)])
    pair = (order, torch.argsort(order))
    return tuple(to_device(t, device) for t in pair) if device is not None else pair


def shift_left(values_T: torch.Tensor, seqlens_padded: Sequence[int]) -> torch.Tensor:
    """``out[t] = values[t + 1]`` inside each segment of the layout, and at each segment's
    last position the segment's first value: a per-token field moved onto the position
    that predicts its token (logits at t score token t + 1). The first token has no
    predicting position; its value goes to the one position that predicts nothing, so the
    shift is a permutation of each segment (a field's sum over the ranks' shares is the
    batch's: a count on a one-token sequence is not lost), and the logprobs there are 0 as
    at a sequence start without CP (``predicts_nothing``). The lengths come from the host,
    so a batch on the GPU is never read back."""
    return values_T.index_select(0, _shift_index(tuple(seqlens_padded), values_T.device))


def predicts_nothing(seqlens_padded: Sequence[int], cp_size: int, cp_rank: int,
                     device: torch.device | None = None) -> torch.Tensor:
    """[t] bool: which of CP rank ``cp_rank``'s positions are a segment's last, whose
    logits score no token of the sequence (``shift_left`` puts the segment's first token
    there; without CP that token's logprob is 0). Kept per layout, read-only."""
    check_cp_layout(seqlens_padded, cp_size)
    return _predicts_nothing(tuple(seqlens_padded), cp_size, cp_rank, device)


@functools.lru_cache(maxsize=16)
def _shift_index(seqlens: tuple[int, ...], device) -> torch.Tensor:
    index = torch.arange(sum(seqlens)) + 1
    ends = torch.tensor(list(accumulate(seqlens)), dtype=torch.long)
    index[ends - 1] = ends - torch.tensor(seqlens, dtype=torch.long)  # the segment's first position
    return to_device(index, device)


@functools.lru_cache(maxsize=16)
def _predicts_nothing(seqlens: tuple[int, ...], cp_size: int, cp_rank: int, device) -> torch.Tensor:
    last = torch.zeros(sum(seqlens), dtype=torch.bool)
    last[torch.tensor(list(accumulate(seqlens)), dtype=torch.long) - 1] = True
    mine = last[_token_index(seqlens, cp_size, cp_rank, None)]
    return to_device(mine, device) if device is not None else mine


def cp_gather(local_t: torch.Tensor, seqlens_padded: Sequence[int], cp_size: int,
              group: dist.ProcessGroup | None) -> torch.Tensor:
    """The whole row [T, ...] from each CP rank's ``local_t`` (its ``cp_token_index``
    tokens), on every rank of ``group``. Not differentiable: for outputs read after the
    forward (logprobs, entropies, stats)."""
    if cp_size == 1:
        return local_t
    parts = collectives.all_gather(local_t.contiguous(), group)
    order, _ = cp_gather_order(seqlens_padded, cp_size, local_t.device)
    out_T = torch.empty((sum(seqlens_padded), *local_t.shape[1:]), dtype=local_t.dtype, device=local_t.device)
    out_T[order] = torch.cat(parts)
    return out_T


def cp_view(batch: PackedBatch, cp_size: int, cp_rank: int, group: dist.ProcessGroup | None) -> PackedBatch:
    """CP rank ``cp_rank``'s share of ``batch`` as the loss reads it: every field is taken
    at the predicting positions (``shift_left``: field[t] belongs to token t + 1, the one
    the logits at t score; a sequence's first token's value goes to its last position,
    which predicts nothing), then cut to the rank's tokens. Its layout is the rank's local one:
    each sequence's 2 chunks are one segment of ``n / cp`` tokens (true lengths are not
    tracked: ``seqlens`` equals the layout's). ``cp_group`` marks it as a share."""
    idx = cp_token_index(batch.seqlens_padded, cp_size, cp_rank, batch.input_ids.device)
    lens = [n // cp_size for n in batch.seqlens_padded]
    cu = to_device(_cumsum(lens), batch.input_ids.device)
    return PackedBatch(
        input_ids=batch.input_ids[idx], position_ids=batch.position_ids[idx], cu_seqlens=cu,
        cu_seqlens_padded=cu, max_seqlen=max(lens), seqlens=lens, seqlens_padded=lens,
        fields={k: shift_left(v, batch.seqlens_padded)[idx] for k, v in batch.fields.items()},
        cp_group=group)
