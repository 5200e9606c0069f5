"""The trainer's side of a weight-update process group with rollout servers.

SGLang joins with ``init_custom_process_group`` (``srt/utils/common.py``, 0.5.10-0.5.23):
a ``tcp://`` rendezvous, then ``PrefixStore(group_name)``, then torch's private
``_new_process_group_helper``, which adds two more key prefixes of its own
(``"{group_name}/"`` and ``"{device}/"``). Any other recipe (say ``ProcessGroupGloo`` on a
plain ``PrefixStore``) waits on different store keys and hangs. So the trainer (rank 0,
the store's host) forms the group through the same torch calls, hosting the store itself
(see below for why not through ``rendezvous``); a contract test runs SGLang's own function
on the other side, with the trainer under torchrun's environment.
"""

from __future__ import annotations

import datetime
import socket

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d


def init_update_group(*, master_address: str, master_port: int, world_size: int,
                      group_name: str, backend: str, timeout_s: float = 600.0) -> dist.ProcessGroup:
    """Hosts the group's store as rank 0 and blocks until all ``world_size`` ranks joined.

    ``group_name`` must be unused in this process: torch refuses a name it already knows.
    """
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"weight_sync.backend must be gloo or nccl, got {backend!r}")
    timeout = datetime.timedelta(seconds=timeout_s)
    # The store SGLang's tcp:// rendezvous would create for rank 0, made directly: under
    # torchrun (TORCHELASTIC_USE_AGENT_STORE=True) torch's rendezvous makes every rank a
    # *client* of the agent's store, so nobody would host this group's store and both
    # sides would wait to connect for ever. Same key space: no prefix, multi-tenant.
    store = dist.TCPStore(master_address, master_port, world_size, is_master=True,
                          timeout=timeout, multi_tenant=True)
    rank, world = 0, world_size
    # torch >= 2.6 names the options argument backend_options (SGLang picks it the same way).
    pg, _ = c10d._new_process_group_helper(world, rank, [], c10d.Backend(backend),
                                           dist.PrefixStore(group_name, store),
                                           group_name=group_name, backend_options=None,
                                           timeout=timeout)
    # Group rank == "global" rank inside this group, as SGLang registers it, so that
    # ``dist.broadcast(t, src=0, group=pg)`` resolves src the same way on both sides.
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world)}
    return pg


def destroy_update_group(pg: dist.ProcessGroup | None) -> None:
    """Frees the group and its name (a re-init under the same name then works)."""
    if pg is not None:
        dist.destroy_process_group(pg)


def routable_address(servers: list[str]) -> str:
    """This host's address on the interface that routes to the first server.

    ``gethostbyname(gethostname())`` can be 127.0.1.1 (Debian's /etc/hosts), which a
    server on another node cannot reach. A UDP ``connect`` picks the route without sending
    a packet; for servers on loopback the answer is loopback, as it should be.
    """
    host, _, port = servers[0].rpartition(":")
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, int(port or 1)))
        return s.getsockname()[0]
