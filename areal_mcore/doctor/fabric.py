"""The fabric check, one process per trainer rank under torchrun, started as the trainer is
(``launcher/slurm.py``'s torchrun step, or torchrun on this machine): an all-reduce over every
rank with the trainer's backend (NCCL on GPUs, gloo on CPU) and, on GPUs, one over a gloo group
too (megatron's gloo groups and our control group use it). Rank 0 writes the result as JSON;
a rank that fails writes its error. Bus bandwidth as nccl-tests reports it: the algorithm
bandwidth (bytes / time) x 2(n-1)/n for an all-reduce.

    python -m torch.distributed.run --nproc-per-node=2 -m areal_mcore.doctor.fabric --out DIR
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time
import traceback
from pathlib import Path


def all_reduce_busbw(tensor, group, iters: int, sync) -> float:
    """Bus bandwidth (bytes/s) of ``iters`` all-reduces of ``tensor`` (on the group's device)
    after two warm-ups."""
    import torch.distributed as dist

    from areal_mcore import collectives

    n = dist.get_world_size(group)
    for _ in range(2):
        collectives.all_reduce(tensor, group)
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        collectives.all_reduce(tensor, group)
    sync()
    seconds = (time.perf_counter() - start) / iters
    size = tensor.numel() * tensor.element_size()
    return size / seconds * (2 * (n - 1) / n if n > 1 else 1.0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--mb", type=int, default=64)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--timeout-s", type=float, default=60.0)
    a = p.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    try:
        result = _run(a)
    except Exception as e:  # noqa: BLE001 - the coordinator reports it as the check's reason
        (a.out / f"fabric_error_rank{rank}.txt").write_text(f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        return 1
    if rank == 0:
        from areal_mcore.run_dir import write_atomic

        write_atomic(a.out / "fabric.json", json.dumps(result), fsync=False)
    return 0


def _run(a) -> dict:
    import torch
    import torch.distributed as dist

    from areal_mcore import collectives
    from areal_mcore.devices import bind_local_device
    from areal_mcore.net import set_nccl_env

    bind_local_device()
    set_nccl_env(os.environ)
    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    timeout = datetime.timedelta(seconds=a.timeout_s)
    dist.init_process_group(backend, timeout=timeout)
    try:
        world = dist.get_world_size()
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        data = torch.ones(a.mb * (1 << 20) // 4, dtype=torch.float32, device=device)
        busbw = all_reduce_busbw(data, None, a.iters, sync)
        if data[0].item() != world ** (a.iters + 2):  # every rank's ones, summed each time
            raise RuntimeError(f"all-reduce gave {data[0].item()}, expected {world ** (a.iters + 2)}")
        result = {"backend": backend, "world": world, "nodes": int(os.environ.get("GROUP_WORLD_SIZE", "1")),
                  "mb": a.mb, "busbw_gbps": busbw / 1e9, "gloo_interface": os.environ.get("GLOO_SOCKET_IFNAME"),
                  "nccl_interface": os.environ.get("NCCL_SOCKET_IFNAME")}
        if cuda:  # the gloo groups beside NCCL
            gloo = dist.new_group(backend="gloo", timeout=timeout)
            small = torch.ones(1 << 18, dtype=torch.float32)
            result["gloo_busbw_gbps"] = all_reduce_busbw(small, gloo, a.iters, lambda: None) / 1e9
        collectives.barrier(None)
        return result
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    raise SystemExit(main())
