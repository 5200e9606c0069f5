"""The weight-sync path between the first trainer node and each rollout node: the update
group formed with the trainer's recipe (weight_sync/group.py) on one side and SGLang's
``init_custom_process_group`` recipe on the other (the embedded server's ``join_group``,
which the contract tests hold to SGLang's own function), then one bucket broadcast, as a
push does. One process per rollout node stands in for its servers' ranks: the path, the
interfaces and the backend are the run's."""

from __future__ import annotations

import time

from areal_mcore.doctor.table import Check, fail

GROUP = "areal_doctor"


def broadcast_probe(*, backend: str, master: str, port: int, rank: int, world: int, mb: int,
                    timeout_s: float, where: str) -> Check:
    """Rank 0 (the first trainer node) hosts the group and sends ``mb`` MB; the others check
    every element they received."""
    import torch

    from areal_mcore import collectives
    from areal_mcore.rollout.embedded.server import join_group
    from areal_mcore.weight_sync.group import destroy_update_group, init_update_group

    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    start = time.perf_counter()
    try:
        if rank == 0:
            pg = init_update_group(master_address=master, master_port=port, world_size=world, group_name=GROUP,
                                   backend=backend, timeout_s=timeout_s)
        else:
            pg = join_group(master_address=master, master_port=port, rank=rank, world_size=world,
                            group_name=GROUP, backend=backend, timeout_s=timeout_s)
        formed = time.perf_counter()
        n = (mb << 20) // 4
        bucket = torch.arange(n, dtype=torch.float32, device=device) if rank == 0 else \
            torch.zeros(n, dtype=torch.float32, device=device)
        collectives.broadcast(bucket, 0, pg)
        if device.type == "cuda":
            torch.cuda.synchronize()
        sent = time.perf_counter()
        wrong = 0 if rank == 0 else int((bucket != torch.arange(n, dtype=torch.float32, device=device)).sum())
        destroy_update_group(pg)
    except Exception as e:  # noqa: BLE001 - the row says what failed
        return fail("weight_sync.broadcast", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                    f"a {backend} group of the trainer and {world - 1} rollout node(s)",
                    f"the rollout nodes must reach {master}:{port} and the trainer node theirs "
                    "(firewall; NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME in launch.env)", where)
    if wrong:
        return fail("weight_sync.broadcast", f"{wrong} of {n} values received wrong", "the bucket sent",
                    "a broken link or NIC on this path: drain the node and run nccl-tests", where)
    return Check("weight_sync.broadcast", "pass", f"{backend} group of {world} formed in {formed - start:.1f} s; "
                 f"{mb} MB bucket in {(sent - formed) * 1e3:.0f} ms", "formed and received", where=where)
