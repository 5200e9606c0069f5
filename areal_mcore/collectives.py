"""The one place our code runs ``torch.distributed`` collectives (megatron runs its own).

Each call puts its tensors on a device the group's backend serves and copies the result
back to where the caller keeps it, so callers may hold bookkeeping tensors on the CPU:
NCCL has no CPU backend (a CPU tensor raises "No backend type associated with device
type cpu"), gloo serves CPU (and CUDA, by staging). The backends a group serves come from
``dist.get_backend_config(group)`` ("cuda:nccl", "cpu:gloo,cuda:gloo",
"cpu:gloo,cuda:nccl"); the CUDA device is ``torch.cuda.current_device()``, which is this
rank's GPU once ``devices.bind_local_device`` ran (torch's own object collectives rely on
the same binding: ``_get_object_coll_device`` picks the current device for NCCL).

Process groups are always passed in; ``src``/``dst`` are global ranks, as in torch.
A test (tests/test_collectives.py) checks no other module calls collectives directly.
"""

from __future__ import annotations

import datetime
import functools
import time
from typing import Any

import torch
import torch.distributed as dist

ReduceOp = dist.ReduceOp


@functools.lru_cache(maxsize=64)
def _served_by_name(config: str) -> frozenset[str]:
    return frozenset(item.split(":", 1)[0] for item in config.split(",") if item)


def served_devices(group: dist.ProcessGroup | None) -> frozenset[str]:
    """Device types ``group``'s backends run collectives on ({"cuda"} for NCCL)."""
    return _served_by_name(dist.get_backend_config(group))


def group_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where to put a tensor for ``group``: the CPU if a backend serves it, else this
    rank's GPU."""
    served = served_devices(group)
    if "cpu" in served:
        return torch.device("cpu")
    if "cuda" in served:
        return torch.device("cuda", torch.cuda.current_device())
    raise RuntimeError(f"process group backends {sorted(served)} serve neither cpu nor cuda")


def on_group_device(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``tensor`` itself if the group serves its device, else a copy on the group's device."""
    if tensor.device.type in served_devices(group):
        return tensor
    return tensor.to(group_device(group))


def _in_place(tensor: torch.Tensor, group, run) -> torch.Tensor:
    """Runs ``run(t)`` on ``tensor`` or its copy on the group's device; copies back."""
    moved = on_group_device(tensor, group)
    run(moved)
    if moved is not tensor:
        tensor.copy_(moved)
    return tensor


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None,
               op: dist.ReduceOp.RedOpType = ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce of ``tensor`` over ``group``; returns ``tensor``."""
    return _in_place(tensor, group, lambda t: dist.all_reduce(t, op=op, group=group))


def all_reduce_with_grad(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The sum of ``tensor`` over ``group``, as a new tensor whose backward all-reduces the
    gradient as well (torch/distributed/nn/functional.py, ``_AllReduce.backward``): for a
    sum that every rank's own loss reads. Tensors stay where they are (the autograd graph
    cannot follow a staging copy), so they must be on a device the group serves."""
    from torch.distributed.nn.functional import all_reduce as all_reduce_autograd

    return all_reduce_autograd(tensor, op=dist.ReduceOp.SUM, group=group)


def broadcast(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """In-place broadcast from global rank ``src``; returns ``tensor``."""
    return _in_place(tensor, group, lambda t: dist.broadcast(t, src=src, group=group))


def broadcast_many(tensors: list[torch.Tensor], src: int, group: dist.ProcessGroup, *,
                   timeout_s: float) -> None:
    """Broadcasts from global rank ``src``, queued back to back and then awaited, all within
    ``timeout_s`` (the weight sync's tensors already live on the actor's device, which the
    group serves); a broadcast still pending then raises ``TimeoutError`` and leaves the
    group to the caller, who aborts it (``transport.TorchGroup.abort``).

    NCCL: the works are polled, never ``Work.wait(timeout)``. Without a timeout NCCL's wait
    returns once the broadcast is queued on the stream, so the host never learns that a peer
    never joined; with one it blocks, and at the bound aborts the communicator itself
    (torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp, ``WorkNCCL::wait``; the abort sets
    the communicator's async error, ``NCCLComm::abort``). The group's watchdog
    (``Watchdog::runLoop``, every 100 ms) reads that error unless the group is already
    terminating (``terminateProcessGroup_``, which only ``_abort_process_group`` sets) and,
    with TORCH_NCCL_ASYNC_ERROR_HANDLING 1 (torchrun) or 3 (the default), takes the process
    down: a race with our abort that the trainer could lose. ``is_completed`` only queries
    the work's end event and the communicator's error (``WorkNCCL::isCompleted``); the
    final ``wait()`` of a completed work orders the current stream after it and raises its
    error, if any. Gloo: its wait honours the timeout and aborts nothing (a receiver that
    never receives: "Operation timed out!", measured)."""
    deadline = time.monotonic() + timeout_s
    moved = [on_group_device(t, group) for t in tensors]
    works = [dist.broadcast(t, src=src, group=group, async_op=True) for t in moved]
    if _nccl_serves(group, moved):
        _complete_on_host(works, deadline, f"NCCL broadcast of {len(tensors)} tensors not complete "
                                           f"after {timeout_s:g} s: a receiver never joined it")
        for w in works:
            w.wait()
    else:
        for w in works:
            w.wait(datetime.timedelta(seconds=max(deadline - time.monotonic(), 1e-3)))
    for t, m in zip(tensors, moved):
        if m is not t:
            t.copy_(m)


def _complete_on_host(works: list, deadline: float | None = None, timeout_message: str = "") -> None:
    """Polls NCCL works until each completed on the device (``WorkNCCL::isCompleted`` queries
    the end event and the communicator's error, and aborts nothing); past ``deadline``
    (``time.monotonic()``), ``TimeoutError(timeout_message)``."""
    while not all(w.is_completed() for w in works):
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(timeout_message)
        time.sleep(1e-4)


def _nccl_serves(group: dist.ProcessGroup, tensors: list[torch.Tensor]) -> bool:
    """Whether NCCL runs ``group``'s collectives on these tensors' device ("cuda:nccl" in
    ``dist.get_backend_config``)."""
    kinds = {t.device.type for t in tensors}
    return any(f"{kind}:nccl" in dist.get_backend_config(group).split(",") for kind in kinds)


def broadcast_pynccl(tensors: list[torch.Tensor], src: int, communicator, *,
                     timeout_s: float) -> None:
    """Broadcasts over one of vLLM's ``PyNcclCommunicator``s (the trainer's side of its
    NCCL weight-transfer group), one tensor at a time on the current stream, as vLLM's
    ``NCCLTrainerWeightTransferEngine._broadcast`` does for unpacked transfers. vLLM's
    communicator has no watchdog, and ``stream.synchronize()`` would wait for ever on a
    peer that never joins: an event polled until ``timeout_s`` bounds the wait (the caller
    then aborts the communicator: ``PyNcclCommunicator.destroy`` is ``ncclCommAbort``)."""
    stream = torch.cuda.current_stream()
    for t in tensors:
        communicator.broadcast(t if t.is_contiguous() else t.contiguous(), src=src, stream=stream)
    done = torch.cuda.Event()
    done.record(stream)
    deadline = time.monotonic() + timeout_s
    while not done.query():
        if time.monotonic() > deadline:
            raise TimeoutError(f"NCCL broadcast of {len(tensors)} tensors not complete after "
                               f"{timeout_s:g} s: a server never received it")
        time.sleep(1e-3)


def all_gather(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    """Every rank's ``tensor`` (same shape everywhere), in group-rank order, on
    ``tensor``'s device."""
    moved = on_group_device(tensor.contiguous(), group)
    parts = [torch.empty_like(moved) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, moved, group=group)
    return parts if moved.device == tensor.device else [p.to(tensor.device) for p in parts]


def gather(tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None) -> list[torch.Tensor] | None:
    """Every rank's ``tensor`` (same shape everywhere), in group-rank order, on global rank
    ``dst`` only (on ``tensor``'s device); None on the other ranks, which keep nothing."""
    moved = on_group_device(tensor.contiguous(), group)
    parts = [torch.empty_like(moved) for _ in range(dist.get_world_size(group))] if dist.get_rank() == dst else None
    dist.gather(moved, parts, dst=dst, group=group)
    if parts is None:
        return None
    return parts if moved.device == tensor.device else [p.to(tensor.device) for p in parts]


def send(tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None) -> None:
    """Point-to-point send to global rank ``dst``."""
    dist.send(on_group_device(tensor.contiguous(), group), dst=dst, group=group)


def recv(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Receives into ``tensor`` from global rank ``src``; returns ``tensor``."""
    return _in_place(tensor, group, lambda t: dist.recv(t, src=src, group=group))


def send_recv_many(sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]],
                   group: dist.ProcessGroup | None) -> None:
    """This rank's point-to-point sends and receives ((tensor, global peer rank) pairs), issued
    as one batch and awaited; received values land in the given tensors. Under NCCL a batch
    runs on the group's own communicator, while each lone send/recv pair gets a 2-rank
    communicator of its own (torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp::pointToPoint:
    ``batchP2P`` keys the communicator by device, a single P2P by the rank pair). The group
    must have run a collective before: a batch that is the group's first needs every rank
    (torch/distributed/distributed_c10d.py::batch_isend_irecv)."""
    moved = [(on_group_device(t, group), t) for t, _ in recvs]
    ops = [dist.P2POp(dist.isend, on_group_device(t.contiguous(), group), peer, group) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, m, peer, group) for (m, _), (_, peer) in zip(moved, recvs)]
    if ops:
        works = dist.batch_isend_irecv(ops)
        # NCCL: complete on the host, not only on the stream (its wait() returns once
        # queued), so the staged copies are freed here and the caller's next batch reuses
        # their memory; a peer that never posts its side is ended by the group's watchdog
        # timeout. Gloo's wait() blocks, and its point-to-point works report completion
        # only through it (polling is_completed() there never ends).
        if _nccl_serves(group, [op.tensor for op in ops]):
            _complete_on_host(works)
        for work in works:
            work.wait()
    for m, t in moved:
        if m is not t:
            t.copy_(m)


def barrier(group: dist.ProcessGroup | None) -> None:
    # NCCL's barrier all-reduces a tensor on the current device: bound ranks required.
    dist.barrier(group=group)


def all_gather_object(obj: Any, group: dist.ProcessGroup | None) -> list:
    """Every rank's picklable ``obj``, in group-rank order (small metadata only: it
    pickles, and NCCL stages it through the current GPU)."""
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj: Any, src: int, group: dist.ProcessGroup | None) -> Any:
    """Global rank ``src``'s picklable ``obj`` on every rank of ``group``."""
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]
