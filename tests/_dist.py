"""Runs a function on N real processes joined by a gloo process group on 127.0.0.1."""

from __future__ import annotations

import os
import pickle
import socket
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, queue):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
        )
        # Plain pickle bytes: tensors sent through the queue as-is would travel as shared
        # memory handles that die with this process before the parent reads them.
        queue.put((rank, pickle.dumps(fn(rank, world_size, *args)), None))
    except BaseException:  # report, so the parent fails with the child's traceback
        queue.put((rank, None, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_gloo(fn, world_size: int = 2, *args) -> list:
    """Returns ``fn(rank, world_size, *args)`` of every rank, in rank order.

    ``fn`` must be a module-level function (it is pickled into spawned processes); the
    default group is the world, and ``fn`` passes ``dist.group.WORLD`` on explicitly.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results = [queue.get() for _ in procs]
    for p in procs:
        p.join(timeout=60)
    errors = [err for _, _, err in results if err]
    if errors:
        raise AssertionError("a gloo rank failed:\n" + "\n".join(errors))
    return [pickle.loads(value) for _, value, _ in sorted(results, key=lambda r: r[0])]
