"""Pushes the actor's weights to the rollout servers after a training step.

Every rank calls ``connect()`` once and ``push(version)`` after each step. Within the first
data-parallel replica, each pipeline stage's TP ranks all-gather their shards bucket by
bucket; the stage's head (TP rank 0) converts them to HF names and layout with the
adapter, casts them to the rollout dtype and broadcasts them over its own update group
(trainer = rank 0, server TP rank r = ``rank_offset + r``), so no rank ever holds more
than its stage. While bucket k is on the wire (HTTP request + broadcast), bucket k+1 is
gathered. Other data-parallel replicas hold the same weights and do nothing.

Groups (``connect``): each stage head forms its own group (``weight_sync/group.py``, the
same store recipe as SGLang's) under a name unique to this connection, one stage at a time:
a server serves ``init_weights_update_group`` calls one by one in arrival order, each
blocking until its group forms, so two stages initialising at once could reach two servers
in opposite orders and wait on each other forever.

Protocol of one push (the coordinator is the head of stage 0), through the servers'
engine (``rollout/engines/``; SGLang's routes here, vLLM's in ``engines/vllm.py``):
pause generation -> begin_weight_update -> each stage in turn: per bucket
``update_weights_from_distributed`` + broadcast -> flush cache (not with pause mode
``in_place``, where SGLang refuses it while requests keep their cache) -> end_weight_update
-> continue. Stages take turns for the same reason as above. The new ``weight_version``
rides on the very last bucket only, so a server that did not get everything still reports
the old version. On any failure every rank raises ``WeightSyncError`` naming the servers;
the update session is closed on every server (SGLang refuses a second begin while one is
open), the groups are re-formed before the next push (a failed broadcast leaves a group
unusable), and the servers stay paused: none serves a half-applied update until a push
succeeds.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from dataclasses import dataclass, field

import torch

from areal_mcore import collectives
from areal_mcore.checks import check_choice, check_positive, field_error
from areal_mcore.devices import inherit_device
from areal_mcore.model import adapter
from areal_mcore.net import free_port
from areal_mcore.rollout.client import ClientConfig, RolloutClient, RolloutError
from areal_mcore.rollout.protocol import PAUSE_MODES
from areal_mcore.rollout.weights import ReusableBuffer
from areal_mcore.weight_sync.buckets import DTYPES, SyncPlan, make_plan, plan_key
from areal_mcore.weight_sync.group import routable_address
from areal_mcore.weight_sync.transport import open_group

MODES = ("distributed", "disk")


@dataclass(kw_only=True)
class WeightSyncConfig:
    mode: str = "distributed"  # or "disk": HF export + update_weights_from_disk
    bucket_mb: float = 1024.0  # AReaL uses 1 GB, slime 512 MB
    dtype: str = "bfloat16"  # the rollout dtype
    flatten: bool = True  # one broadcast per bucket (load_format=flattened_bucket)
    backend: str = "auto"  # nccl with CUDA, else gloo
    master_address: str | None = None  # None: this node's address on the route to the servers
    master_port: int | None = None  # stage s uses master_port + s; None: a free port
    group_name: str = "areal_weight_sync"  # prefix; each connection adds a unique suffix
    # SGLang's pause_generation mode: abort (requests are resubmitted with what they
    # generated), retract (back to the queue, cache recomputed) or in_place (kept with
    # their cache: old-weight KV, no flush).
    pause_mode: str = "abort"
    disk_dir: str | None = None
    timeout_s: float = 600.0  # the update groups' (store, rendezvous, NCCL watchdog)
    # How long one bucket's broadcast may take before the push fails; None: timeout_s / 2.
    # Below timeout_s, so that NCCL's watchdog (which ends the process) never fires first.
    bucket_timeout_s: float | None = None

    def __post_init__(self):
        check_choice("mode", self.mode, MODES)
        check_choice("dtype", self.dtype, tuple(sorted(DTYPES)))
        check_choice("backend", self.backend, ("auto", "nccl", "gloo"))
        check_positive("bucket_mb", self.bucket_mb)
        check_choice("pause_mode", self.pause_mode, PAUSE_MODES)
        if self.bucket_timeout_s is not None and not 0 < self.bucket_timeout_s < self.timeout_s:
            raise field_error("bucket_timeout_s", self.bucket_timeout_s,
                              f"must be > 0 and below timeout_s ({self.timeout_s:g}): the update "
                              "group's own timeout would end the trainer first (NCCL's watchdog)")
        if self.mode == "disk" and not self.disk_dir:
            raise field_error("disk_dir", self.disk_dir, "is needed with mode=disk (a shared filesystem path)")


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
    dropped_servers: list[str] = field(default_factory=list)  # dead: out of the fleet for good

    def fail(self, what: str, error: BaseException) -> None:
        self.failures.append(f"{what}: {error}")
        self.failed_servers += getattr(error, "failed", [])


class WeightSyncer:
    # How long a bucket's HTTP answers are awaited after its broadcast failed (``_answers``).
    answer_grace_s = 5.0
    # How long the servers' group teardown is awaited (best effort, ``_destroy_group``).
    destroy_timeout_s = 10.0

    def __init__(self, cfg: WeightSyncConfig, actor, addresses: list[str], *,
                 api_key: str | None = None, backend: str = "sglang"):
        self.cfg = cfg
        self.actor = actor
        g = actor.groups
        self.g = g
        self.participates = g.dp_rank == 0 or cfg.mode == "disk"
        self.is_sender = g.dp_rank == 0 and g.tp_rank == 0  # head of this stage
        self.is_coordinator = self.is_sender and g.pp_rank == 0
        # The servers' engine protocol (rollout/engines/) comes with the client.
        self.client = (RolloutClient(ClientConfig(addresses=addresses, api_key=api_key,
                                                  backend=backend))
                       if self.is_sender else None)
        self._plan: SyncPlan | None = None
        self._group = None
        self.group_name: str | None = None  # this connection's group (stage heads)
        self._spec = None  # its GroupSpec (what the engine's bucket requests name)
        self._regroup = False  # a push failed: form fresh groups before the next one
        self.stalled: list[str] = []  # servers the rollout side found stalled (the trainer sets it)
        self._device = next(actor.model.module.parameters()).device
        self._buffers = (ReusableBuffer(self._device), ReusableBuffer(self._device))

    def _in_thread(self, fn, *args, **kwargs):
        """``fn`` on a worker thread bound to this rank's GPU: every thread job here touches
        CUDA (the object all-gather over NCCL, the gather, the broadcast, the group), and a
        worker thread's current device is cuda:0 until set (devices.inherit_device)."""
        return asyncio.to_thread(inherit_device(fn, self._device), *args, **kwargs)

    def _in_daemon_thread(self, fn, *args, **kwargs) -> asyncio.Future:
        """``_in_thread`` on a daemon thread of its own: a rendezvous or a gloo send that a
        refusing server left waiting runs on to its timeout without holding the process at
        exit (the default executor's threads are joined then: a failed setup exited 120 s
        late)."""
        loop, done = asyncio.get_running_loop(), asyncio.get_running_loop().create_future()
        bound = inherit_device(fn, self._device)

        def settle(result, error) -> None:
            if done.done():
                return
            if error is not None:
                done.set_exception(error)
            else:
                done.set_result(result)

        def run() -> None:
            try:
                result, error = bound(*args, **kwargs), None
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
                result, error = None, e
            try:
                loop.call_soon_threadsafe(settle, result, error)
            except RuntimeError:  # the loop is gone: nobody waits for this any more
                if error is None and hasattr(result, "close"):
                    result.close()
        threading.Thread(target=run, name=f"weight-sync-{fn.__name__}", daemon=True).start()
        return done

    # ---- plan --------------------------------------------------------------------------
    def plan(self) -> SyncPlan:
        """This stage's plan; rebuilt only when the parameter shapes change."""
        shapes = {n: p.shape for n, p in adapter.module_weights(self.actor.model.module).items()}
        if self._plan is None or self._plan.key != plan_key(shapes):
            self._plan = make_plan(shapes, self.actor.args, tp_size=self.g.tp_size,
                                   pp_rank=self.g.pp_rank, pp_size=self.g.pp_size,
                                   dtype=self.cfg.dtype, bucket_bytes=int(self.cfg.bucket_mb * 2**20))
        return self._plan

    # ---- setup ----------------------------------------------------------------------
    async def connect(self) -> None:
        """Starts the HTTP client and forms each stage's update group with every server."""
        stats = SyncStats()
        if self.is_sender:
            await self.client.start()
        if self.is_coordinator:
            try:
                if self.cfg.mode == "distributed":
                    self.client.check_distributed_updates(self.g.pp_size)
                # A trainer restarted against surviving servers may find the session its
                # predecessor left open; SGLang would refuse every begin until it is closed.
                await self.client.end_weight_update(best_effort=True)
            except RolloutError as e:
                stats.fail("checking the rollout servers", e)
        await self._agree(stats, "connecting to the rollout servers")
        if self.cfg.mode == "distributed":
            await self._form_groups()

    async def _form_groups(self) -> None:
        """Stage by stage: the previous group (if any) is destroyed, a fresh one formed."""
        for stage in range(self.g.pp_size):
            stats = SyncStats()
            if self.is_sender and stage == self.g.pp_rank:
                try:
                    await self._destroy_group()
                    await self._form_group()
                except (RolloutError, RuntimeError, ValueError) as e:
                    stats.fail(f"forming the update group of stage {stage}", e)
            await self._agree(stats, f"forming the update group of stage {stage}")
        self._regroup = False

    async def _form_group(self) -> None:
        cfg = self.cfg
        address = cfg.master_address or routable_address(self.client.cfg.addresses)
        port = cfg.master_port + self.g.pp_rank if cfg.master_port else free_port(address)
        backend = cfg.backend if cfg.backend != "auto" else (
            "nccl" if torch.cuda.is_available() else "gloo")
        # Unique per connection: torch (and so SGLang) refuses a group name it already
        # holds, and a group of a trainer that died may still be registered on a server.
        name = f"{cfg.group_name}_pp{self.g.pp_rank}_{uuid.uuid4().hex[:8]}"
        spec = self.client.group_spec(master_address=address, master_port=port,
                                      group_name=name, backend=backend, stage=self.g.pp_rank)
        join = asyncio.ensure_future(self.client.engine.init_group(self.client, spec))
        rendezvous = asyncio.ensure_future(self._in_daemon_thread(
            open_group, self.client.engine.trainer_transport(backend),
            master_address=address, master_port=port,
            world_size=self.client.weight_group_world_size(), group_name=name,
            backend=backend, timeout_s=cfg.timeout_s))
        # A server that refuses to join fails the setup at once: this side would wait for
        # it in the rendezvous until weight_sync.timeout_s (its store waits for every rank).
        await asyncio.wait({join, rendezvous}, return_when=asyncio.FIRST_EXCEPTION)
        if join.done() and join.exception() is not None:
            rendezvous.add_done_callback(_close_late_group)
            raise join.exception()
        self._group = await rendezvous
        self.group_name, self._spec = name, spec
        await join

    async def _destroy_group(self) -> None:
        """Servers first (best effort: one may be dead), then this side."""
        if self.group_name is None:
            return
        try:
            # Bounded: a server left in a bucket's receive (a peer died mid-update) serves
            # the destroy on its engine thread only after its group's timeout (600 s).
            await asyncio.wait_for(self.client.destroy_weights_update_group(
                self.group_name, backend=self._spec.backend), self.destroy_timeout_s)
        except (RolloutError, asyncio.TimeoutError):
            pass
        self._close_local_group()
        self.group_name, self._spec = None, None

    def _close_local_group(self, *, abort: bool = False) -> None:
        """This side only (idempotent): its gloo pairs close, so a server waiting in a
        receive of this group fails there at once ("connection closed by peer");
        ``abort``: a broadcast may be pending (transport.py)."""
        group, self._group = self._group, None
        if group is not None:
            group.abort() if abort else group.close()

    async def close(self) -> None:
        if self.client is not None:
            self.client.drop(self.stalled)  # they would not answer the destroy
            await self._destroy_group()
            await self.client.close()

    # ---- one update --------------------------------------------------------------------
    async def push(self, version: int) -> SyncStats:
        """Makes every server serve this actor's weights as ``version`` (all ranks call)."""
        stats = SyncStats()
        start = time.perf_counter()
        if self.cfg.mode == "disk":
            await self._push_disk(version, stats)
        elif self.participates:
            stats.dropped_servers = await self._drop_dead_servers()
            if self._regroup:
                await self._form_groups()
            try:
                await self._coordinate(stats, "pausing the servers", self._begin)
                for stage in range(self.g.pp_size):
                    if stage == self.g.pp_rank:
                        await self._send_stage(version, stats)
                    await self._agree(stats, f"sending stage {stage}")
                await self._coordinate(stats, "resuming the servers",
                                       lambda: self._finish(version))
            except WeightSyncError:
                self._regroup = True
                if self.is_coordinator:  # no session may stay open: the next begin would fail
                    await self.client.end_weight_update(best_effort=True)
                raise
        stats.total_s = time.perf_counter() - start
        return stats

    async def _drop_dead_servers(self) -> list[str]:
        """Servers that no longer answer ``/health`` (a lost node, kill -9), and those the
        rollout side found stalled (``stalled``: a pause would wait on them), leave the sync
        for good and the push goes on to the others, in groups re-formed without them (the
        rollout side stopped sending them work when they refused a connection, and drops
        them too: back at the same address, they would serve old weights). The coordinator
        probes; every participating rank learns the verdict."""
        dead: list[str] = []
        if self.is_coordinator:
            dead = await self.client.dead_servers(known=self.stalled)
        group = self.g.mp if self.cfg.mode == "distributed" else None
        dead = sorted({a for part in await self._in_thread(collectives.all_gather_object, dead, group)
                       for a in part})
        if not dead:
            return []
        if self.is_sender:
            self.client.drop(dead)
            if not self.client.servers:
                raise WeightSyncError(f"no rollout server left: {dead} no longer answer /health", dead)
        if self.is_coordinator:
            print(f"[weight_sync] rollout server(s) {dead} no longer answer /health: syncing the other "
                  f"{len(self.client.servers)} from now on", flush=True)
        self._regroup = True  # the groups' world size changed
        return dead

    async def _begin(self) -> None:
        await self.client.begin_update(self.cfg.pause_mode)

    async def _finish(self, version: int) -> None:
        await self.client.finish_update(self.cfg.pause_mode, str(version))

    async def _coordinate(self, stats: SyncStats, what: str, step) -> None:
        if self.is_coordinator:
            try:
                await step()
            except RolloutError as e:
                stats.fail(what, e)
        await self._agree(stats, what)

    async def _agree(self, stats: SyncStats, what: str) -> None:
        """Every participating rank learns every failure and all raise together (the
        all-gather doubles as the barrier between stages)."""
        if not self.participates:
            return
        group = self.g.mp if self.cfg.mode == "distributed" else None  # disk: every rank
        everyone = await self._in_thread(collectives.all_gather_object,
                                           (stats.failures, stats.failed_servers), group)
        messages = [m for ms, _ in everyone for m in ms]
        servers = sorted({s for _, ss in everyone for s in ss})
        if messages:
            raise WeightSyncError(
                f"weight sync failed while {what}: {'; '.join(messages)}. Failed servers: "
                f"{servers or 'unknown'}; the servers stay paused with their old weight_version "
                f"until a sync completes.", servers)

    async def _send_stage(self, version: int, stats: SyncStats) -> None:
        plan = self.plan()
        n = len(plan.buckets)
        if not self.is_sender:  # TP peers: take part in every bucket's all-gather
            for i in range(n):
                self._gather(plan, i, stats)
            return
        last_stage = self.g.pp_rank == self.g.pp_size - 1
        payload = await self._in_thread(self._gather, plan, 0, stats)
        for i in range(n):
            nxt = (asyncio.ensure_future(self._in_thread(self._gather, plan, i + 1, stats))
                   if i + 1 < n else None)  # overlaps this bucket's send
            if stats.failures:  # keep gathering: TP peers must not be left in a collective
                payload = await nxt if nxt else None
                continue
            names, shapes = plan.bucket_meta(i)
            http = asyncio.ensure_future(self._timed(stats, "http_s", self.client.update_bucket(
                names=names, dtypes=[plan.dtype] * len(names), shapes=shapes,
                group=self._spec, flatten=self._flatten(),
                weight_version=str(version) if last_stage and i == n - 1 else None)))
            # On a daemon thread: a gloo send to a server that refused the bucket runs on to
            # its bound after the push failed (_answers), without holding the exit.
            wire = asyncio.ensure_future(
                self._timed(stats, "wire_s", self._in_daemon_thread(self._broadcast, payload)))
            for what, r in ((f"bucket {i} request", await self._answers(http, wire)),
                            (f"bucket {i} broadcast", wire.done() and wire.exception())):
                if r:  # None, False (a refused bucket's broadcast still pending) or the error
                    stats.fail(what, r)
            if not stats.failures:
                stats.bytes += sum(t.numel() * t.element_size() for t in payload)
                stats.buckets += 1
            if nxt:
                payload = await nxt

    async def _answers(self, http: asyncio.Future, wire: asyncio.Future) -> BaseException | None:
        """The bucket request's error, if any, once the broadcast is over or cannot be.

        A server that refused the bucket before its receive (the engines' update routes
        answer at the first server's refusal: ``fail_fast``) never takes part in the
        broadcast, which would wait for it to its bound: the group is aborted (NCCL's
        pending broadcast ends; a gloo send runs on, on its daemon thread, to
        ``bucket_timeout_s``) and the push fails at once. A broadcast that failed (a
        receiver died: gloo raises at once, NCCL at its bound) may leave the other servers
        of the group without the bucket, in their receive: this side of the group is
        closed, which fails that receive, and their answers are waited for
        ``answer_grace_s`` at most; the request is then cancelled and the error names the
        servers the client found dead (a refused connection marks a server unhealthy)."""
        await asyncio.wait({http, wire}, return_when=asyncio.FIRST_COMPLETED)
        if not wire.done() and http.exception() is not None:
            wire.add_done_callback(lambda f: f.cancelled() or f.exception())  # nobody awaits it
            self._close_local_group(abort=True)
            return http.exception()
        await asyncio.wait({wire})
        if wire.exception() is not None:
            # The group is unusable now (it is re-formed before the next push). Closing
            # this side ends the survivors' receive at once; otherwise their engines sat in
            # it until the group's timeout (SGLang's join carries none: 600 s), serving
            # nothing, while this trainer went on.
            self._close_local_group(abort=True)
            await asyncio.wait({http}, timeout=self.answer_grace_s)
            if not http.done():
                http.cancel()
                await asyncio.gather(http, return_exceptions=True)
                dead = [s.address for s in self.client.servers if not s.healthy]
                return RolloutError(f"cancelled {self.answer_grace_s:g} s after the broadcast "
                                    f"failed; servers found dead: {dead or 'none'}", dead)
        await asyncio.gather(http, return_exceptions=True)
        return http.exception()

    def _flatten(self) -> bool:
        return self.cfg.flatten and (self._spec is None or
                                     self.client.engine.flattened_buckets(self._spec.backend))

    @staticmethod
    async def _timed(stats: SyncStats, key: str, aw):
        t = time.perf_counter()
        try:
            return await aw
        finally:
            setattr(stats, key, getattr(stats, key) + time.perf_counter() - t)

    def _gather(self, plan: SyncPlan, i: int, stats: SyncStats) -> list[torch.Tensor] | None:
        """TP all-gather of bucket ``i``; on the stage head, its HF tensors ready to send."""
        t0 = time.perf_counter()
        g, weights = self.g, adapter.module_weights(self.actor.model.module)
        names = [u.mcore for u in plan.buckets[i]]
        shards: list[dict[str, torch.Tensor]] = [{} for _ in range(g.tp_size)]
        for name in names:
            local = weights[name].detach()
            if g.tp_size == 1:
                shards[0][name] = local
                continue
            parts = collectives.all_gather(local, g.tp)
            for r in range(g.tp_size):
                shards[r][name] = parts[r]
        t1 = time.perf_counter()
        stats.gather_s += t1 - t0
        if not self.is_sender:
            return None
        hf = adapter.to_hf(shards, self.actor.args, pp_rank=g.pp_rank, pp_size=g.pp_size,
                           only=set(names))
        order, shapes = plan.bucket_meta(i)
        # Two buffers: bucket i + 1 is filled while bucket i is on the wire.
        payload = pack_bucket(self._buffers[i % 2], [hf[n] for n in order], shapes,
                              DTYPES[plan.dtype], flatten=self._flatten())
        stats.convert_s += time.perf_counter() - t1
        return payload

    def _broadcast(self, payload: list[torch.Tensor]) -> None:
        bound = self.cfg.bucket_timeout_s or self.cfg.timeout_s / 2
        self._group.send_bucket(payload, bound)

    async def _push_disk(self, version: int, stats: SyncStats) -> None:
        from areal_mcore.convert.save_hf import save_hf

        t = time.perf_counter()
        # Written before the pause: generation goes on while the export is written.
        await self._in_thread(save_hf, self.actor, self.cfg.disk_dir, dtype=DTYPES[self.cfg.dtype])
        stats.convert_s = time.perf_counter() - t

        async def load() -> None:
            await self.client.update_weights_from_disk(self.cfg.disk_dir, weight_version=str(version),
                                                       pause_mode=self.cfg.pause_mode)
        await self._coordinate(stats, "loading the export from disk", load)


def pack_bucket(buffer: ReusableBuffer, tensors: list[torch.Tensor], shapes: list[list[int]],
                dtype: torch.dtype, *, flatten: bool) -> list[torch.Tensor]:
    """Casts and packs one bucket into the reused buffer in a single pass; returns what
    goes on the wire: one ``uint8`` tensor (a flattened bucket: SGLang receives it as
    ``uint8`` of the same bytes, ``weight_sync/tensor_bucket.py``, and NCCL/gloo need the
    same dtype and count on both ends) or one tensor per name."""
    flat, views = buffer.views(shapes, dtype)
    for view, t in zip(views, tensors, strict=True):
        view.copy_(t)
    return [flat.view(torch.uint8)] if flatten else views


def _close_late_group(rendezvous: asyncio.Future) -> None:
    """The trainer's side of a group a server refused: closed if it formed after all, its
    timeout error consumed (nobody awaits it)."""
    if not rendezvous.cancelled() and rendezvous.exception() is None:
        rendezvous.result().close()
