"""Weight sync: actor -> rollout servers (the one package that knows both)."""

from __future__ import annotations


def weight_syncer(cfg, actor, servers, *, api_key: str | None = None, backend: str = "sglang",
                  root: str | None = None, stall: tuple[float, float] | None = None):
    """The syncer of ``cfg.mode`` (``WeightSyncConfig``) for this rank. ``servers``: the
    rollout side's ``Fleet`` (shared: on the trainer's rank 0), or the servers' addresses
    (a fleet of its own on the ranks that talk to the servers). ``root``: the run
    directory; the disk sync exports under it only (``DiskSync``). ``stall``: (stall_after_s,
    stall_probe_s) for a fleet of its own (``Syncer``)."""
    from areal_mcore.rollout.fleet import Fleet
    from areal_mcore.weight_sync.disk import DiskSync, disk_roles
    from areal_mcore.weight_sync.distributed import DistributedSync, distributed_roles

    kind, roles = ((DiskSync, disk_roles) if cfg.mode == "disk" else
                   (DistributedSync, distributed_roles))
    shared = servers if isinstance(servers, Fleet) else None
    extra = {"root": root} if kind is DiskSync else {}
    return kind(cfg, actor, roles(actor.groups), fleet=shared,
                addresses=None if shared else list(servers or []), api_key=api_key, backend=backend,
                stall=stall, **extra)
