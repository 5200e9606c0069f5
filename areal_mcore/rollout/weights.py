"""Weights into a served model: receiving broadcast buckets, and loading HF-named tensors
by name the way SGLang's ``load_weights`` does (rotary buffers skipped, a tied lm_head
skipped, an unknown name or a shape mismatch is an error). MoE experts arrive under the
checkpoint files' per-expert names and land in transformers' stacked parameters
(``stacked_target``)."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

import torch
import torch.distributed as dist

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def receive_flat(group: dist.ProcessGroup, buffer: ReusableBuffer, names: list[str],
                 dtypes: list[str], shapes: list[list[int]]) -> list[tuple[str, torch.Tensor]]:
    """One broadcast of a flattened bucket: SGLang receives it as ``uint8`` of the bucket's
    byte size (``weight_sync/tensor_bucket.py``), and the sender must send the same type
    and count (NCCL and gloo match both). Tensors are views into the reused buffer."""
    sizes, offset = [], 0
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        item = DTYPES[dtype].itemsize
        if offset % item:
            raise ValueError(f"unaligned tensor {name} in a flattened bucket: byte offset "
                             f"{offset}, dtype {dtype}")
        sizes.append(math.prod(shape) * item)
        offset += sizes[-1]
    flat, parts = buffer.views([[n] for n in sizes], torch.uint8)
    group.broadcast(flat, 0).wait()
    return [(name, part.view(DTYPES[dtype]).view(shape))
            for name, part, dtype, shape in zip(names, parts, dtypes, shapes)]


def receive_each(group: dist.ProcessGroup, model, names: list[str], dtypes: list[str],
                 shapes: list[list[int]]) -> list[tuple[str, torch.Tensor]]:
    """One broadcast per tensor, queued back to back; a tensor whose parameter has its
    dtype lands in the parameter itself."""
    received, works = [], []
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        target = receive_target(model, name, DTYPES[dtype], shape)
        t = torch.empty(shape, dtype=DTYPES[dtype]) if target is None else target
        works.append(group.broadcast(t, 0))
        received.append((name, t))
    for w in works:
        w.wait()
    return received


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


# HF checkpoint files name each expert (mlp.experts.{e}.{gate,up,down}_proj.weight); transformers
# >= 5 stacks them in memory: Qwen3MoeExperts.gate_up_proj [E, 2 x I, H] (gate rows first: its
# forward chunks the product in two) and down_proj [E, H, I] (modeling_qwen3_moe.py).
_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def stacked_target(params: dict[str, torch.Tensor], name: str) -> torch.Tensor | None:
    """The slice of a stacked expert parameter that a per-expert checkpoint name fills (a
    view: writing it writes the parameter); None for other names or unstacked models."""
    m = _PER_EXPERT.match(name)
    if m is None:
        return None
    prefix, e, proj = m.group(1), int(m.group(2)), m.group(3)
    p = params.get(f"{prefix}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}")
    if p is None or e >= p.shape[0]:
        return None
    if proj == "down_proj":
        return p.data[e]
    half = p.shape[1] // 2
    return p.data[e, :half] if proj == "gate_proj" else p.data[e, half:]


def _param(params: dict[str, torch.Tensor], name: str) -> torch.Tensor | None:
    return params[name] if name in params else stacked_target(params, name)


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
        p = _param(params, name)
        if p is None:
            errors.append(f"unknown weight {name!r}")
        elif list(p.shape) != list(shape):
            errors.append(f"{name}: shape {list(shape)} but the served model has {list(p.shape)}")
    if errors:
        raise ValueError("; ".join(errors[:5]) + (f" (+{len(errors) - 5} more)" if len(errors) > 5 else ""))


def receive_target(model, name: str, dtype: torch.dtype, shape) -> torch.Tensor | None:
    """The parameter itself when a broadcast can land in it (known name, same dtype and
    shape, contiguous); otherwise the caller receives into a fresh tensor."""
    if _skipped(model, name):
        return None
    try:
        p = model.get_parameter(name)
    except AttributeError:
        p = stacked_target(dict(model.named_parameters()), name)
        if p is None:
            return None  # unknown: received, then refused by check_weights
    ok = p.dtype == dtype and list(p.shape) == list(shape) and p.is_contiguous()
    return p.data if ok else None


@torch.no_grad()
def load_weights(model, named: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Copies tensors into the model's parameters by HF name; returns how many loaded."""
    params = dict(model.named_parameters())
    loaded = 0
    for name, tensor in named:
        if _skipped(model, name):
            continue
        p = _param(params, name)
        if p.data_ptr() != tensor.data_ptr():  # not received in place
            p.copy_(tensor)
        loaded += 1
    return loaded
