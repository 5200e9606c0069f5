"""Weight sync through a shared filesystem: every rank writes the actor's HF export to
``weight_sync.disk_dir`` (while the servers go on generating), then the coordinator has
the servers load it, paused around the load (the engine's ``from_disk``)."""

from __future__ import annotations

import time

from areal_mcore.weight_sync.buckets import DTYPES
from areal_mcore.weight_sync.syncer import Roles, Syncer, SyncStats


def disk_roles(g) -> Roles:
    """Every rank writes its part of the export; stage 0's head of replica 0 alone talks
    to the servers."""
    head = g.dp_rank == 0 and g.tp_rank == 0 and g.pp_rank == 0
    return Roles(participates=True, sender=head, coordinator=head, group=None)


class DiskSync(Syncer):
    async def _push(self, version: int, stats: SyncStats) -> None:
        from areal_mcore.convert.save_hf import save_hf

        t = time.perf_counter()
        await self._in_thread(save_hf, self.actor, self.cfg.disk_dir, dtype=DTYPES[self.cfg.dtype])
        stats.convert_s = time.perf_counter() - t

        async def load() -> None:
            await self.updater.from_disk(self.cfg.disk_dir, str(version), self.cfg.pause_mode)
        await self.coordinate(stats, "loading the export from disk", load)
