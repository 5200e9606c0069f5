"""Runs a function on N real processes joined by a gloo process group on 127.0.0.1."""

from __future__ import annotations

import os
import pickle
import traceback
from queue import Empty

import _tiers
import torch.distributed as dist
import torch.multiprocessing as mp

from areal_mcore.devices import bind_local_device
from areal_mcore.net import free_port

# Ranks fork from multiprocessing's forkserver, which imported these once, instead of each
# spawned rank importing them again: ~8 s of CPU per rank, and the suite starts hundreds.
# areal_mcore before megatron: it installs the hook that keeps megatron's fusions eager on
# CPU (areal_mcore/model/eager_fusions.py), which spares the import dynamo and inductor.
PRELOAD = ["torch", "torch.distributed", "transformers", "areal_mcore", "megatron.core",
           "areal_mcore.actor.megatron_actor", "areal_mcore.trainer.ppo", "_actor_setup",
           # torch.optim.Optimizer.__init__ imports dynamo (torch/_compile.py, _disable_dynamo):
           # 1-3 s in every rank that trains, once here
           "torch._dynamo"]


def rank_context():
    """The multiprocessing context for test ranks (a forkserver with ``PRELOAD`` imported)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _worker(rank, world_size, port, fn, args, queue, test_marks=None, env=None):
    if env is not None:  # the test's environment now, not the forkserver's at its start
        os.environ.clear()
        os.environ.update(env)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        _tiers.guard_server_launches(test_marks)
        bind_local_device({"LOCAL_RANK": str(rank)})  # a no-op without CUDA
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
    if world_size > 1:
        _tiers.needs("multirank")
    ctx = rank_context()
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, _tiers.marks(),
                                          dict(os.environ)))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results = []
    while len(results) < world_size:
        try:
            results.append(queue.get(timeout=5))
        except Empty:  # a rank that died without reporting (segfault, OOM kill) fails the test
            dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead and len(results) + len(dead) >= world_size or len(dead) == world_size:
                for p in procs:
                    p.kill()
                raise AssertionError(f"gloo ranks died without a result: (rank, exit code) {dead}") from None
    for p in procs:
        p.join(timeout=60)
    errors = [err for _, _, err in results if err]
    if errors:
        raise AssertionError("a gloo rank failed:\n" + "\n".join(errors))
    return [pickle.loads(value) for _, value, _ in sorted(results, key=lambda r: r[0])]
