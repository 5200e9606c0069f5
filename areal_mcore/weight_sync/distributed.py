"""Weight sync over update groups: the actor's tensors broadcast from the trainer to the
servers' ranks, bucket by bucket (SGLang's ``update_weights_from_distributed``, vLLM's
weight-transfer engine, the embedded server's own; the engine's ``WeightUpdater`` says
which routes and which group).

Within the first data-parallel replica, each pipeline stage's TP ranks all-gather their
shards bucket by bucket; the stage's head (TP rank 0) converts them to HF names and layout
with the adapter, casts them to the rollout dtype and broadcasts them over its own update
group (trainer = rank 0, server TP rank r = ``rank_offset + r``), so no rank ever holds more
than its stage. While bucket k is on the wire (HTTP request + broadcast), bucket k+1 is
gathered and packed into the second of two buffers, unit by unit (``_gather``): two buckets
and, at TP > 1, one unit's shards and their concatenation at most
(``buckets.sync_memory_bytes``, what the memory plan charges). Other data-parallel replicas
hold the same weights and do nothing.

Groups (``connect``): each stage head forms its own group (``group.py``, the same store
recipe as SGLang's) under a name unique to this connection, one stage at a time: a server
serves ``init_weights_update_group`` calls one by one in arrival order, each blocking until
its group forms, so two stages initialising at once could reach two servers in opposite
orders and wait on each other forever.

One push (the coordinator is the head of stage 0): begin (pause generation, open the
update session) -> each stage in turn: per bucket, the servers' receive + the broadcast ->
finish (flush the cache unless pause mode ``in_place``, close the session, set the
version, resume). Stages take turns for the same reason as above. The new
``weight_version`` rides on the very last bucket only, so a server that did not get
everything still reports the old version. On any failure every rank raises
``WeightSyncError`` naming the servers; the update session is closed on every server
(SGLang refuses a second begin while one is open), the groups are re-formed before the
next push (a failed broadcast leaves a group unusable), and the servers stay paused: none
serves a half-applied update until a push succeeds. A push that failed because servers
went (kill -9, a lost node) is done again to the survivors (``Syncer.push``).
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

import torch
import torch.distributed as dist

from areal_mcore import collectives
from areal_mcore.devices import inherit_device
from areal_mcore.model import adapter
from areal_mcore.net import free_port
from areal_mcore.rollout.protocol import RolloutError
from areal_mcore.rollout.weights import ReusableBuffer
from areal_mcore.weight_sync.buckets import DTYPES, SyncPlan, Unit, make_plan, plan_key
from areal_mcore.weight_sync.group import routable_address
from areal_mcore.weight_sync.syncer import Roles, Syncer, SyncStats, WeightSyncError
from areal_mcore.weight_sync.transport import open_group


def distributed_roles(g) -> Roles:
    """One whole copy of the model takes part (the others hold the same weights); each
    stage's head sends.

    With expert parallelism a copy's experts are spread over EP ranks that are other
    data-parallel ranks: the copy is megatron's expert-TP x EP x PP group of expert-data-
    parallel rank 0, and the head of its EP rank 0 sends. At EP=1 (expert-TP = TP) that
    group has the ranks of replica 0's TP x PP group and expert-DP ranks are DP ranks
    (checked at TP/PP 1-2 on 4 ranks, megatron-core 0.16.1 and 0.19.2)."""
    participates = g.expert_dp_rank == 0
    sender = participates and g.ep_rank == 0 and g.tp_rank == 0
    return Roles(participates=participates, sender=sender, coordinator=sender and g.pp_rank == 0,
                 group=g.expert_mp)


class DistributedSync(Syncer):
    # How long a bucket's HTTP answers are awaited after its broadcast failed (``_answers``).
    answer_grace_s = 5.0
    # How long the servers' group teardown is awaited (best effort, ``_destroy_group``).
    destroy_timeout_s = 10.0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._plan: SyncPlan | None = None
        self._group = None  # this stage head's end of its update group (transport.py)
        self._spec = None  # its GroupSpec (what the servers' bucket requests name)
        self._regroup = False  # a push failed: form fresh groups before the next one
        self._buffers = (ReusableBuffer(self._device), ReusableBuffer(self._device))

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

    def plan(self) -> SyncPlan:
        """This stage's plan; rebuilt only when the parameter shapes change."""
        shapes = {n: p.shape for n, p in adapter.module_weights(self.actor.model.module).items()}
        if self._plan is None or self._plan.key != plan_key(shapes):
            self._plan = make_plan(shapes, self.actor.args, tp_size=self.g.tp_size,
                                   pp_rank=self.g.pp_rank, pp_size=self.g.pp_size, ep_size=self.g.ep_size,
                                   dtype=self.cfg.dtype, bucket_bytes=int(self.cfg.bucket_mb * 2**20))
        return self._plan

    # ---- setup --------------------------------------------------------------------------
    async def _check(self) -> None:
        self.updater.check_distributed(self.g.pp_size)
        await super()._check()

    async def connect(self) -> None:
        """Also forms each stage's update group with every server."""
        await super().connect()
        await self._form_groups()

    async def _form_groups(self) -> None:
        """Stage by stage: the previous group (if any) is destroyed, a fresh one formed."""
        for stage in range(self.g.pp_size):
            stats = SyncStats()
            if self.roles.sender and stage == self.g.pp_rank:
                try:
                    await self._destroy_group()
                    await self._form_group()
                except (RolloutError, RuntimeError, ValueError) as e:
                    stats.fail(f"forming the update group of stage {stage}", e)
            await self.agree(stats, f"forming the update group of stage {stage}")
        self._regroup = False

    async def _form_group(self) -> None:
        cfg = self.cfg
        address = cfg.master_address or routable_address([s.address for s in self.fleet.servers])
        port = cfg.master_port + self.g.pp_rank if cfg.master_port else free_port(address)
        backend = cfg.backend if cfg.backend != "auto" else (
            "nccl" if torch.cuda.is_available() else "gloo")
        # Unique per connection: torch (and so SGLang) refuses a group name it already
        # holds, and a group of a trainer that died may still be registered on a server.
        name = f"{cfg.group_name}_pp{self.g.pp_rank}_{uuid.uuid4().hex[:8]}"
        spec = self.updater.group_spec(master_address=address, master_port=port,
                                       group_name=name, backend=backend, stage=self.g.pp_rank)
        join = asyncio.ensure_future(self.updater.init_group(spec))
        rendezvous = asyncio.ensure_future(self._in_daemon_thread(
            open_group, self.updater.transport(backend), master_address=address,
            master_port=port, world_size=spec.world_size, group_name=name, backend=backend,
            timeout_s=cfg.timeout_s))
        # A server that refuses to join fails the setup at once: this side would wait for
        # it in the rendezvous until weight_sync.timeout_s (its store waits for every rank).
        await asyncio.wait({join, rendezvous}, return_when=asyncio.FIRST_EXCEPTION)
        if join.done() and join.exception() is not None:
            rendezvous.add_done_callback(_close_late_group)
            raise join.exception()
        self._group = await rendezvous
        self._spec = spec
        await join

    async def _destroy_group(self) -> None:
        """Servers first (best effort: one may be dead), then this side."""
        if self._spec is None:
            return
        try:
            # Bounded: a server left in a bucket's receive (a peer died mid-update) serves
            # the destroy on its engine thread only after its group's timeout (600 s).
            await asyncio.wait_for(self.updater.destroy_group(self._spec), self.destroy_timeout_s)
        except (RolloutError, asyncio.TimeoutError):
            pass
        self._close_local_group()
        self._spec = None

    def _close_local_group(self, *, abort: bool = False) -> None:
        """This side only (idempotent): its gloo pairs close, so a server waiting in a
        receive of this group fails there at once ("connection closed by peer");
        ``abort``: a broadcast may be pending (transport.py)."""
        group, self._group = self._group, None
        if group is not None:
            group.abort() if abort else group.close()

    async def close(self) -> None:
        if self.roles.sender:
            await self._destroy_group()
        await super().close()

    # ---- one update ------------------------------------------------------------------------
    async def _push(self, version: int, stats: SyncStats) -> None:
        if self._regroup:
            await self._form_groups()
        # Bucket 0 is gathered and packed now: its TP all-gathers run at the same point on
        # every rank of the stage, never beside another collective.
        first = await self._in_thread(self._gather, self.plan(), 0, stats)
        try:
            await self.coordinate(stats, "pausing the servers",
                                  lambda: self.updater.begin(self.cfg.pause_mode))
            for stage in range(self.g.pp_size):
                if stage == self.g.pp_rank:
                    await self._send_stage(version, stats, first)
                await self.agree(stats, f"sending stage {stage}")
            await self.coordinate(stats, "resuming the servers",
                                  lambda: self.updater.finish(self.cfg.pause_mode, str(version)))
        except WeightSyncError:
            self._regroup = True
            if self.roles.coordinator:  # no session may stay open: the next begin would fail
                await self.updater.end(best_effort=True)
            raise

    def _servers_changed(self) -> None:
        self._regroup = True  # the groups' world size changed

    async def _send_stage(self, version: int, stats: SyncStats, first: list[torch.Tensor] | None) -> None:
        """This stage's buckets; ``first``: bucket 0's payload."""
        plan = self.plan()
        n = len(plan.buckets)
        if not self.roles.sender:  # TP peers: take part in every later bucket's all-gathers
            for i in range(1, n):
                self._gather(plan, i, stats)
            return
        last_stage = self.g.pp_rank == self.g.pp_size - 1
        payload = first
        for i in range(n):
            nxt = (asyncio.ensure_future(self._in_thread(self._gather, plan, i + 1, stats))
                   if i + 1 < n else None)  # overlaps this bucket's send
            if stats.failures:  # keep gathering: TP peers must not be left in a collective
                payload = await nxt if nxt else None
                continue
            names, shapes = plan.bucket_meta(i)
            http = asyncio.ensure_future(self._timed(stats, "http_s", self.updater.receive_bucket(
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
                dead = [s.address for s in self.fleet.servers if not s.healthy]
                return RolloutError(f"cancelled {self.answer_grace_s:g} s after the broadcast "
                                    f"failed; servers found dead: {dead or 'none'}", dead)
        await asyncio.gather(http, return_exceptions=True)
        return http.exception()

    def _flatten(self) -> bool:
        return self.cfg.flatten and (self._spec is None or
                                     self.updater.flattened(self._spec.backend))

    @staticmethod
    async def _timed(stats: SyncStats, key: str, aw):
        t = time.perf_counter()
        try:
            return await aw
        finally:
            setattr(stats, key, getattr(stats, key) + time.perf_counter() - t)

    def _gather(self, plan: SyncPlan, i: int, stats: SyncStats) -> list[torch.Tensor] | None:
        """Bucket ``i`` as it goes on the wire (HF names and layout, the rollout dtype) on the
        stage head; None on its TP peers, which take part in its gathers.

        Unit by unit: a unit is gathered, converted and copied into this bucket's buffer
        before the next one is gathered, so beside the two buffers (this bucket's, and the
        one on the wire) a push holds one unit's gathered shards and their concatenation at
        most (``buckets.sync_memory_bytes``). Where nothing is gathered (TP=1, this EP rank's
        own weights) the HF tensors are views of the parameters, and an unflattened bucket
        sends what is contiguous in the rollout dtype as it is (``pack_bucket``)."""
        t0, gather_s = time.perf_counter(), stats.gather_s
        units, g = plan.buckets[i], self.g
        weights = adapter.module_weights(self.actor.model.module)
        if not self.roles.sender:
            for unit in units:
                self._collect(weights, unit, stats)
            return None
        _, shapes = plan.bucket_meta(i)
        dtype, buffer, flatten = DTYPES[plan.dtype], self._buffers[i % 2], self._flatten()
        gathers = g.tp_size > 1 or any(u.ep_rank not in (None, g.ep_rank) and g.ep_size > 1 for u in units)
        if not flatten and not gathers:
            views = [t for u in units for t in self._convert(weights, u, stats)]
            payload = pack_bucket(buffer, views, shapes, dtype, flatten=False)
        else:
            flat, slots = buffer.views(shapes, dtype)
            k = 0
            for unit in units:
                self._convert(weights, unit, stats, into=slots[k:k + len(unit.hf)])
                k += len(unit.hf)
            payload = [flat.view(torch.uint8)] if flatten else slots
        stats.convert_s += time.perf_counter() - t0 - (stats.gather_s - gather_s)
        return payload

    def _convert(self, weights: dict[str, torch.Tensor], unit: Unit, stats: SyncStats, *,
                 into: list[torch.Tensor] | None = None) -> list[torch.Tensor] | None:
        """``unit``'s HF tensors (views where the layout allows); with ``into``, copied into
        those slots (cast to their dtype) instead, and the gathered shards and their
        concatenation freed on return."""
        hf = adapter.merge(unit.kind, self._collect(weights, unit, stats), self.actor.args)
        if into is None:
            return hf
        for slot, t in zip(into, hf, strict=True):
            slot.copy_(t)
        return None

    def _collect(self, weights: dict[str, torch.Tensor], unit: Unit, stats: SyncStats) -> list[torch.Tensor]:
        """``unit``'s megatron tensor on every TP rank (an all-gather over TP; at TP=1 the
        parameter itself). An expert unit of another EP rank first comes from that rank:
        its owner broadcasts its shard over the EP group, every TP rank its own (local
        expert names are the same on every EP rank, each for other global experts)."""
        t0 = time.perf_counter()
        g, local = self.g, weights[unit.mcore].detach()
        if unit.ep_rank is not None and g.ep_size > 1:
            owned = local if unit.ep_rank == g.ep_rank else torch.empty_like(local)
            local = collectives.broadcast(owned, dist.get_global_rank(g.ep, unit.ep_rank), g.ep)
        parts = [local] if g.tp_size == 1 else collectives.all_gather(local, g.tp)
        stats.gather_s += time.perf_counter() - t0
        return parts

    def _broadcast(self, payload: list[torch.Tensor]) -> None:
        bound = self.cfg.bucket_timeout_s or self.cfg.timeout_s / 2
        self._group.send_bucket(payload, bound)


def pack_bucket(buffer: ReusableBuffer, tensors: list[torch.Tensor], shapes: list[list[int]],
                dtype: torch.dtype, *, flatten: bool) -> list[torch.Tensor]:
    """What goes on the wire for one bucket: one ``uint8`` tensor (a flattened bucket:
    SGLang receives it as ``uint8`` of the same bytes, ``weight_sync/tensor_bucket.py``,
    and NCCL/gloo need the same dtype and count on both ends), every tensor cast and packed
    into the reused buffer in a single pass; or one tensor per name, where a tensor that
    is already contiguous in the rollout dtype goes as it is (with TP=1 and the actor in
    the rollout dtype, a view of the parameter itself: no copy, no buffer) and the others
    are cast into the buffer. The actor's parameters do not change during a push: the
    trainer awaits it before the next step."""
    if flatten:
        flat, views = buffer.views(shapes, dtype)
        for view, t in zip(views, tensors, strict=True):
            view.copy_(t)
        return [flat.view(torch.uint8)]
    out = [t if t.dtype == dtype and t.is_contiguous() else None for t in tensors]
    todo = [i for i, t in enumerate(out) if t is None]
    _, views = buffer.views([shapes[i] for i in todo], dtype)
    for i, view in zip(todo, views, strict=True):
        view.copy_(tensors[i])
        out[i] = view
    return out


def _close_late_group(rendezvous: asyncio.Future) -> None:
    """The trainer's side of a group a server refused: closed if it formed after all, its
    timeout error consumed (nobody awaits it)."""
    if not rendezvous.cancelled() and rendezvous.exception() is None:
        rendezvous.result().close()
