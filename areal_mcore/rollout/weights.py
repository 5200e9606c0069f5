"""Weights into a served model: the update process group, and loading HF-named tensors by
name the way SGLang's ``load_weights`` does (rotary buffers skipped, a tied lm_head
skipped, an unknown name or a shape mismatch is an error)."""

from __future__ import annotations

import datetime
import math
from collections.abc import Iterable

import torch
import torch.distributed as dist

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def init_weight_group(*, master_address: str, master_port: int, rank: int, world_size: int,
                      group_name: str, backend: str, timeout_s: float = 600.0) -> dist.ProcessGroup:
    """A process group outside torch's default group (the trainer already has one).

    Rank 0 (the trainer) hosts the store; blocks until all ``world_size`` ranks joined.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, master_port, world_size, is_master=(rank == 0),
                          timeout=timeout)
    store = dist.PrefixStore(group_name, store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, opts)
    raise ValueError(f"weight update backend must be gloo or nccl, got {backend!r}")


def broadcast(group: dist.ProcessGroup, tensor: torch.Tensor, src: int = 0) -> None:
    group.broadcast(tensor, src).wait()


class ReusableBuffer:
    """A growing flat buffer per dtype whose slices hold one bucket's tensors back to back.

    Reused by every update: allocating a fresh bucket each time costs page faults on CPU
    (and allocator churn on GPU), and the flat view is what a flattened bucket sends.
    """

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = device
        self._bufs: dict[torch.dtype, torch.Tensor] = {}

    def views(self, shapes: list[list[int]], dtype: torch.dtype) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(the flat slice, one view per shape) — valid until the next call."""
        sizes = [math.prod(s) for s in shapes]
        total = sum(sizes)
        buf = self._bufs.get(dtype)
        if buf is None or buf.numel() < total:
            buf = self._bufs[dtype] = torch.empty(total, dtype=dtype, device=self.device)
        flat = buf[:total]
        return flat, [p.view(s) for p, s in zip(flat.split(sizes), shapes)]


def _skipped(model, name: str) -> bool:
    tied = getattr(model.config, "tie_word_embeddings", False)
    return "rotary_emb.inv_freq" in name or (tied and name == "lm_head.weight")


def check_weights(model, names: list[str], shapes: list[list[int]]) -> None:
    """Raises ``ValueError`` naming every unknown name or wrong shape, before any copy."""
    params = dict(model.named_parameters())
    errors = []
    for name, shape in zip(names, shapes, strict=True):
        if _skipped(model, name):
            continue
        if name not in params:
            errors.append(f"unknown weight {name!r}")
        elif list(params[name].shape) != list(shape):
            errors.append(f"{name}: shape {list(shape)} but the served model has "
                          f"{list(params[name].shape)}")
    if errors:
        raise ValueError("; ".join(errors[:5]) + (f" (+{len(errors) - 5} more)" if len(errors) > 5 else ""))


def receive_target(model, name: str, dtype: torch.dtype) -> torch.Tensor | None:
    """The parameter itself when a broadcast can land in it (same dtype, contiguous)."""
    if _skipped(model, name):
        return None
    p = model.get_parameter(name)
    return p.data if p.dtype == dtype and p.is_contiguous() else None


@torch.no_grad()
def load_weights(model, named: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Copies tensors into the model's parameters by HF name; returns how many loaded."""
    params = dict(model.named_parameters())
    loaded = 0
    for name, tensor in named:
        if _skipped(model, name):
            continue
        if params[name].data_ptr() != tensor.data_ptr():  # not received in place
            params[name].copy_(tensor)
        loaded += 1
    return loaded
