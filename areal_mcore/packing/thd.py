"""THD packing: B variable-length sequences laid end to end in one 1-D token row.

Shape legend: B = sequences, T = packed tokens (padding included), B1 = B + 1.

Every per-token tensor is aligned with ``input_ids``: position ``t`` of a field belongs
to token ``t`` (a field may carry more per token along trailing dims, e.g. the routed
experts [T, moe_layers, top_k]). Optional padding rounds each sequence up to a multiple of ``N`` (TP × CP
alignment for TransformerEngine); padded positions hold ``pad_token_id`` in
``input_ids`` and zero in every field, so a ``loss_mask`` field masks them out of the
loss. ``cu_seqlens`` gives the true sequence boundaries, ``cu_seqlens_padded`` the
layout of the packed row (TE's ``cu_seqlens_q_padded``); without padding they are one
tensor. The lengths are also kept on the host (``seqlens``, ``seqlens_padded``): on a GPU
the batch lives on the device, and reading a device tensor's values (``.tolist()``,
``torch.equal``) blocks the host until the GPU has caught up.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from itertools import accumulate

import torch


@dataclass
class PackedBatch:
    """A THD batch. ``max_seqlen`` is the longest segment of the packed layout."""

    input_ids: torch.Tensor  # [T]
    position_ids: torch.Tensor  # [T], restarting at 0 for each sequence
    cu_seqlens: torch.Tensor  # [B1] int32, true lengths
    cu_seqlens_padded: torch.Tensor  # [B1] int32, layout of the packed row (cu_seqlens itself if unpadded)
    max_seqlen: int
    seqlens: list[int]  # the true lengths, on the host
    seqlens_padded: list[int]  # segment lengths of the layout (what micro-batch budgets count), on the host
    fields: dict[str, torch.Tensor] = field(default_factory=dict)  # each [T] or [T, ...]
    pad_to_multiple_of: int = 1
    # Set on one context-parallel rank's share of a micro-batch (packing/cp.py, ``cp_view``):
    # each sequence's tokens are spread over this group, so per-sequence sums add up over it.
    cp_group: object | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seqlens)

    @property
    def padded(self) -> bool:
        """Whether any segment carries padding (then cu_seqlens_padded is its own tensor)."""
        return self.seqlens != self.seqlens_padded

    def to(self, device: torch.device | str) -> PackedBatch:
        """This batch with every tensor on ``device`` (the loss reads the fields beside the
        model's logits, so a micro-batch moves as a whole), without waiting for the GPU
        (``to_device``)."""
        cu = to_device(self.cu_seqlens, device)
        return replace(self, input_ids=to_device(self.input_ids, device),
                       position_ids=to_device(self.position_ids, device), cu_seqlens=cu,
                       cu_seqlens_padded=to_device(self.cu_seqlens_padded, device) if self.padded else cu,
                       fields={k: to_device(v, device) for k, v in self.fields.items()})

    def select(self, indices: Sequence[int]) -> PackedBatch:
        """The sub-batch of the given sequences, in that order, with the same padding."""
        return self.select_many([indices])[0]

    def select_many(self, groups: Sequence[Sequence[int]]) -> list[PackedBatch]:
        """One sub-batch per group of sequence indices (e.g. micro-batches); unpacks once."""
        seqs, fields = unpack(self)
        return [pack([seqs[i] for i in g], {k: [v[i] for i in g] for k, v in fields.items()},
                     pad_to_multiple_of=self.pad_to_multiple_of) for g in groups]

    def split(self, values_T: torch.Tensor) -> list[torch.Tensor]:
        """Cuts any per-token tensor of this layout back into per-sequence tensors."""
        if values_T.shape[0] != self.input_ids.shape[0]:
            raise ValueError(
                f"tensor has {values_T.shape[0]} tokens, the packed batch has "
                f"{self.input_ids.shape[0]}"
            )
        starts = accumulate(self.seqlens_padded[:-1], initial=0)
        return [values_T[s : s + n] for s, n in zip(starts, self.seqlens)]


def pack(
    seqs: Sequence[torch.Tensor],
    fields: dict[str, Sequence[torch.Tensor]] | None = None,
    *,
    pad_to_multiple_of: int = 1,
    pad_token_id: int = 0,
) -> PackedBatch:
    """Packs 1-D token tensors (and per-token fields of the same lengths) into THD.

    Args:
        seqs: B 1-D integer tensors, each at least one token long.
        fields: name -> B tensors, each as long as its sequence along dim 0 (loss_mask,
            logprobs, versions, ...; trailing dims are kept, e.g. routed_experts).
        pad_to_multiple_of: pad each sequence up to a multiple of this many tokens.
        pad_token_id: token id written into the padding.

    Returns:
        The packed batch; ``unpack`` inverts it exactly.
    """
    if not seqs:
        raise ValueError("pack() needs at least one sequence")
    if pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of={pad_to_multiple_of} must be >= 1")
    fields = dict(fields or {})
    lens = [int(s.numel()) for s in seqs]
    for i, s in enumerate(seqs):
        if s.dim() != 1 or s.numel() == 0:
            raise ValueError(f"sequence {i} must be a non-empty 1-D tensor, got shape {tuple(s.shape)}")
    for name, values in fields.items():
        if len(values) != len(seqs):
            raise ValueError(f"field {name!r} has {len(values)} entries for {len(seqs)} sequences")
        for i, (v, n) in enumerate(zip(values, lens)):
            if v.dim() < 1 or v.shape[0] != n:
                raise ValueError(f"field {name!r} of sequence {i} has shape {tuple(v.shape)}, expected ({n}, ...)")

    m = pad_to_multiple_of
    padded = [-(-n // m) * m for n in lens]
    device = seqs[0].device

    def lay_out(parts: Sequence[torch.Tensor], fill) -> torch.Tensor:
        if m == 1:
            return torch.cat(list(parts))
        out_T = torch.full((sum(padded), *parts[0].shape[1:]), fill, dtype=parts[0].dtype, device=device)
        for start, part in zip(accumulate(padded[:-1], initial=0), parts):
            out_T[start : start + part.shape[0]] = part
        return out_T

    position_ids_T = torch.cat([torch.arange(p, device=device) for p in padded])
    # Where no segment is padded, both boundaries are one tensor: TE 2.4-2.10 compares
    # them on the device in every attention layer unless they alias
    # (transformer_engine/pytorch/attention/dot_product_attention/dot_product_attention.py::
    # DotProductAttention.forward, pad_between_seqs; torch's cuda_equal returns early for
    # aliases, aten/src/ATen/native/cuda/Equal.cpp::cuda_equal).
    cu_padded_B1 = to_device(_cumsum(padded), device)
    return PackedBatch(
        input_ids=lay_out(seqs, pad_token_id),
        position_ids=position_ids_T,
        cu_seqlens=cu_padded_B1 if padded == lens else to_device(_cumsum(lens), device),
        cu_seqlens_padded=cu_padded_B1,
        max_seqlen=max(padded),
        seqlens=lens,
        seqlens_padded=padded,
        fields={name: lay_out(values, 0) for name, values in fields.items()},
        pad_to_multiple_of=m,
    )


def unpack(batch: PackedBatch) -> tuple[list[torch.Tensor], dict[str, list[torch.Tensor]]]:
    """Inverse of ``pack``: the sequences and the fields, padding removed."""
    return batch.split(batch.input_ids), {k: batch.split(v) for k, v in batch.fields.items()}


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` on ``device``; from the CPU to a GPU without making the host wait for the GPU.
    A blocking copy synchronises the stream (aten/src/ATen/native/cuda/Copy.cu::
    copy_kernel_cuda: ``memcpy_and_sync``), and an asynchronous one from pageable memory
    may too (CUDA runtime API, "API synchronization behavior": the driver "may synchronize
    with the stream" to stage it); from pinned memory it is queued. The pinned block is
    not reused before the copy completes (torch's CachingHostAllocator records an event
    for it: copy_kernel_cuda, ``record_event``)."""
    if t.device.type == "cpu" and torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _cumsum(lens: list[int]) -> torch.Tensor:
    out = torch.zeros(len(lens) + 1, dtype=torch.int32)
    out[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int64), 0)
    return out
