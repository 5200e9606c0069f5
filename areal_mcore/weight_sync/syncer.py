"""What every weight sync shares, whatever its transport (``distributed.py``: update
groups; ``disk.py``: an HF export): the ranks' roles, the servers (a ``Fleet`` and the
engine's ``WeightUpdater``, ``rollout/engines/base.py``), and one rule for failures: every
rank that takes part learns every failure (``agree``) and all raise ``WeightSyncError``
together, so none is left waiting in a collective the others gave up.

Every rank calls ``connect()`` once, ``push(version)`` after each step and ``close()``
at the end.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from areal_mcore import collectives
from areal_mcore.devices import inherit_device
from areal_mcore.rollout.engines import engine_for
from areal_mcore.rollout.fleet import Fleet
from areal_mcore.rollout.protocol import RolloutError
from areal_mcore.weight_sync.config import WeightSyncConfig


class WeightSyncError(RuntimeError):
    def __init__(self, message: str, failed_servers: list[str]):
        super().__init__(message)
        self.failed_servers = failed_servers


@dataclass
class SyncStats:
    """Seconds spent per phase on this rank (phases overlap: they need not sum to total)."""

    total_s: float = 0.0
    gather_s: float = 0.0
    convert_s: float = 0.0
    http_s: float = 0.0
    wire_s: float = 0.0
    bytes: int = 0
    buckets: int = 0
    failures: list[str] = field(default_factory=list)
    failed_servers: list[str] = field(default_factory=list)
    dropped_servers: list[str] = field(default_factory=list)  # gone: out of the fleet for good

    def fail(self, what: str, error: BaseException) -> None:
        self.failures.append(f"{what}: {error}")
        self.failed_servers += getattr(error, "failed", [])


@dataclass(frozen=True)
class Roles:
    """A rank's part in a sync, computed once from its parallel ranks."""

    participates: bool  # takes part in the agreements (and so in the push)
    sender: bool  # talks to the servers: its stage's head (TP rank 0) in replica 0
    coordinator: bool  # pauses and resumes the servers: the sender of stage 0
    group: object  # who agrees: replica 0's model-parallel group, or None (every rank)


async def agree(roles: Roles, stats: SyncStats, what: str, in_thread) -> None:
    """Every participating rank learns every failure and all raise together (the
    all-gather doubles as the barrier between stages)."""
    if not roles.participates:
        return
    everyone = await in_thread(collectives.all_gather_object,
                               (stats.failures, stats.failed_servers), roles.group)
    messages = [m for ms, _ in everyone for m in ms]
    servers = sorted({s for _, ss in everyone for s in ss})
    if messages:
        raise WeightSyncError(
            f"weight sync failed while {what}: {'; '.join(messages)}. Failed servers: "
            f"{servers or 'unknown'}; the servers stay paused with their old weight_version "
            f"until a sync completes.", servers)


class Syncer:
    """The transport-independent part; ``fleet``: the rollout side's (shared: a server
    either finds gone is gone for both), else one of its own on the ranks that talk to
    the servers, made from ``addresses``, its control calls watched for stalls by
    ``stall`` (rollout.stall_after_s, stall_probe_s)."""

    def __init__(self, cfg: WeightSyncConfig, actor, roles: Roles, *, fleet: Fleet | None,
                 addresses: list[str] | None, api_key: str | None, backend: str,
                 stall: tuple[float, float] | None = None):
        self.cfg, self.actor, self.roles, self.g = cfg, actor, roles, actor.groups
        engine = engine_for(backend)
        self._owns_fleet = fleet is None and roles.sender
        if self._owns_fleet:
            fleet = Fleet(addresses, api_key=api_key, dead_engine=engine.dead_engine)
            if stall is not None:  # as the rollout client sets its own (RolloutClient)
                fleet.stall_after_s, fleet.stall_probe_s = stall
        self.fleet = fleet if roles.sender else None
        self.updater = engine.updater(self.fleet) if roles.sender else None
        self._device = next(actor.model.module.parameters()).device

    def _in_thread(self, fn, *args, **kwargs):
        """``fn`` on a worker thread bound to this rank's GPU: every thread job here touches
        CUDA (the object all-gather over NCCL, the gather, the broadcast, the group), and a
        worker thread's current device is cuda:0 until set (devices.inherit_device)."""
        return asyncio.to_thread(inherit_device(fn, self._device), *args, **kwargs)

    async def agree(self, stats: SyncStats, what: str) -> None:
        await agree(self.roles, stats, what, self._in_thread)

    async def coordinate(self, stats: SyncStats, what: str, step) -> None:
        """``step()`` on the coordinator, then everyone agrees on how it went."""
        if self.roles.coordinator:
            try:
                await step()
            except RolloutError as e:
                stats.fail(what, e)
        await self.agree(stats, what)

    async def connect(self) -> None:
        """Starts talking to the servers; a session a trainer that died left open is closed
        (SGLang would refuse every begin until then)."""
        if self._owns_fleet:
            await self.fleet.start()
            await self.updater.engine.detect_all(self.fleet)
        await self.coordinate(SyncStats(), "connecting to the rollout servers", self._check)

    async def _check(self) -> None:
        await self.updater.end(best_effort=True)

    async def close(self) -> None:
        if self._owns_fleet:
            await self.fleet.close()

    async def push(self, version: int) -> SyncStats:
        """Makes every server serve this actor's weights as ``version`` (all ranks call).

        Servers found gone (``_drop_gone_servers``) before the push, or after a push that
        failed, leave the fleet; a push that failed while some went is done again to the
        survivors (a server killed mid-push fails the whole push: its broadcast cannot
        complete for anyone). A failure with no server gone, or with none left, raises."""
        start = time.perf_counter()
        stats = SyncStats()
        if not self.roles.participates:
            return stats
        dropped = await self._drop_gone_servers()
        while True:
            try:
                await self._push(version, stats)
                break
            except WeightSyncError:
                gone = await self._drop_gone_servers()
                if not gone:
                    raise
                dropped += gone
                stats = SyncStats()
                if self.roles.coordinator:
                    print(f"[weight_sync] pushing version {version} again, to the other "
                          f"{len(self.fleet.servers)} server(s): {gone} went during the push", flush=True)
        stats.dropped_servers = dropped
        stats.total_s = time.perf_counter() - start
        return stats

    async def _drop_gone_servers(self) -> list[str]:
        """Servers that no longer answer ``/health`` (a lost node, kill -9), whose port
        another process holds now, that the rollout side found stalled (a pause would wait
        on them) or faulty (repeated bad answers: ``Fleet.gone_servers``), leave the fleet for good, in groups re-formed without them (back at
        the same address they would serve old weights). The coordinator probes; every
        participating rank learns the verdict. Raises when none is left."""
        gone = await self.fleet.gone_servers() if self.roles.coordinator else []
        gone = sorted({a for part in await self._in_thread(collectives.all_gather_object, gone,
                                                           self.roles.group) for a in part})
        if not gone:
            return []
        if self.roles.sender:
            self.fleet.drop(gone)
            if not self.fleet.servers:
                raise WeightSyncError(f"no rollout server left: {gone} are gone (no answer to /health, "
                                      "stalled, their port taken over, or repeated bad answers)", gone)
        if self.roles.coordinator:
            print(f"[weight_sync] rollout server(s) {gone} are gone (no answer to /health, stalled, their port "
                  f"taken over, or repeated bad answers): syncing the other {len(self.fleet.servers)} from now on",
                  flush=True)
        self._servers_changed()
        return gone

    def _servers_changed(self) -> None:
        """The fleet lost servers (the distributed sync re-forms its groups)."""

    async def _push(self, version: int, stats: SyncStats) -> None:
        raise NotImplementedError
