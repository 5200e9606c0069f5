"""Which accelerator this rank drives: bound once from ``LOCAL_RANK`` at each entry point.

torchrun (and our srun steps) start one process per GPU and tell each its index on the
node in ``LOCAL_RANK``. CUDA does not read it: until ``torch.cuda.set_device`` is called,
``torch.cuda.current_device()`` is 0 in every process, and megatron-core allocates with
``device=torch.cuda.current_device()`` throughout, so all eight ranks of a node would pile
onto GPU 0 (and NCCL refuses two ranks on one device). Hence: bind before any CUDA work,
i.e. before ``init_process_group("nccl")`` and before the actor is built.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from typing import TypeVar

import torch

T = TypeVar("T")


def local_rank(environ: Mapping[str, str] = os.environ) -> int:
    """This process's index on its node (torchrun's ``LOCAL_RANK``; 0 when run alone)."""
    text = environ.get("LOCAL_RANK", "0")
    if not text.isdigit():
        raise ValueError(f"LOCAL_RANK={text!r} is not a GPU index on this node")
    return int(text)


def bind_local_device(environ: Mapping[str, str] = os.environ) -> torch.device:
    """Makes GPU ``LOCAL_RANK`` this process's current CUDA device; returns the device
    (``cpu`` without CUDA). Call first thing in every entry point that starts ranks.

    A launcher that hands each rank only its own GPU (``CUDA_VISIBLE_DEVICES`` of one
    index, e.g. ``srun --gpus-per-task=1``) leaves one visible device: that one is bound.
    """
    if not torch.cuda.is_available():
        return torch.device("cpu")
    rank, visible = local_rank(environ), torch.cuda.device_count()
    index = 0 if visible == 1 else rank
    if index >= visible:
        raise RuntimeError(
            f"LOCAL_RANK={rank} but this process sees {visible} GPUs (CUDA_VISIBLE_DEVICES="
            f"{environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): start at most {visible} ranks per node "
            f"(torchrun --nproc-per-node) or give each rank its own GPU")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def check_bound(environ: Mapping[str, str] = os.environ) -> None:
    """Raises when CUDA is present and the current device is not this rank's GPU, i.e. an
    entry point forgot ``bind_local_device`` (every rank would share GPU 0)."""
    if not torch.cuda.is_available():
        return
    visible = torch.cuda.device_count()
    expected = 0 if visible == 1 else local_rank(environ)
    current = torch.cuda.current_device()
    if current != expected:
        raise RuntimeError(
            f"this rank (LOCAL_RANK={local_rank(environ)}) is on cuda:{current}, not cuda:{expected}: call "
            f"areal_mcore.devices.bind_local_device() before any CUDA work in the entry point")


def inherit_device(fn: Callable[..., T], device: torch.device | None = None) -> Callable[..., T]:
    """``fn``, run on ``device`` (default: the calling thread's current CUDA device) from
    whatever thread runs it.

    The current CUDA device is per thread: a worker thread (``asyncio.to_thread``, the
    trainer's event-loop thread) that never set it works on cuda:0, and so do torch's
    object collectives over NCCL (``distributed_c10d._get_object_coll_device``) and
    ``torch.cuda.current_stream()``: every rank's control-plane traffic on GPU 0 ("Duplicate
    GPU detected" with TP/PP > 1). Wrap every function a thread runs for a bound one."""
    if not torch.cuda.is_available() or (device is not None and device.type != "cuda"):
        return fn
    index = torch.cuda.current_device() if device is None else device.index

    @functools.wraps(fn)
    def bound(*args, **kwargs):
        torch.cuda.set_device(index)
        return fn(*args, **kwargs)
    return bound
