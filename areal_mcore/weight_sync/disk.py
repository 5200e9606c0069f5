"""Weight sync through a shared filesystem: every rank writes the actor's HF export to
``weight_sync.disk_dir`` (while the servers go on generating), then the coordinator has
the servers load it, paused around the load (the engine's ``from_disk``). In a run the
export stays under the run directory, the only tree the servers the run launches load
from (``--weights-root`` of the embedded server; docs/rollout.md#security)."""

from __future__ import annotations

import os
import time

from areal_mcore.checks import field_error
from areal_mcore.rollout.auth import within
from areal_mcore.weight_sync.buckets import DTYPES
from areal_mcore.weight_sync.syncer import Roles, Syncer, SyncStats


def disk_roles(g) -> Roles:
    """Every rank writes its part of the export; stage 0's head of replica 0 (of its CP
    rank 0: CP ranks hold the same weights) alone talks to the servers."""
    head = g.dp_rank == 0 and g.cp_rank == 0 and g.tp_rank == 0 and g.pp_rank == 0
    return Roles(participates=True, sender=head, coordinator=head, group=None)


def export_dir(disk_dir: str, root: str | None) -> str:
    """Where the export goes: ``weight_sync.disk_dir``, a relative one taken from ``root``
    (the run directory; None: no run, the path as given). Refused outside ``root``: the
    servers a run launches load only from under it, and the sync never sends them elsewhere."""
    if root is None:
        return disk_dir
    path = disk_dir if os.path.isabs(disk_dir) else os.path.join(root, disk_dir)
    if not within(path, root):
        raise field_error("weight_sync.disk_dir", disk_dir,
                          f"is outside the run directory {root}: the rollout servers load weights from under "
                          "it only; give a path under it, or a relative one (taken from it)")
    return os.path.abspath(path)  # a server need not share our working directory


class DiskSync(Syncer):
    def __init__(self, cfg, actor, roles: Roles, *, root: str | None = None, **kwargs):
        super().__init__(cfg, actor, roles, **kwargs)
        self.export_dir = export_dir(cfg.disk_dir, root)

    async def _push(self, version: int, stats: SyncStats) -> None:
        from areal_mcore.convert.save_hf import save_hf

        t = time.perf_counter()
        await self._in_thread(save_hf, self.actor, self.export_dir, dtype=DTYPES[self.cfg.dtype])
        stats.convert_s = time.perf_counter() - t

        async def load() -> None:
            await self.updater.from_disk(self.export_dir, str(version), self.cfg.pause_mode)
        await self.coordinate(stats, "loading the export from disk", load)
