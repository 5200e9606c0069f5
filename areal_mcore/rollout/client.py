"""Async client for a fleet of rollout servers (SGLang, vLLM or embedded).

The engine's protocol (request/response translation, pause/abort, weight updates) comes
from ``rollout/engines/``; this module is the part every engine shares.

``generate`` sends token ids to the least-loaded healthy server and fails over to another
on connection errors, timeouts and 5xx, keeping the request id: each call returns exactly
one completion. A completion aborted by ``pause_generation`` or a weight update is
resubmitted with what it has generated so far (the server holds it until
``continue_generation``), and each token remembers the weight version that produced it
(SGLang's ``meta_info.weight_versions`` spans where the server reports them). Every HTTP
attempt carries a fresh wire rid (``<rid>.<attempt>``): a retried request never collides
with its own earlier attempt whose abort has not finished ("Duplicate request ID").
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import statistics
import time
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import aiohttp

from areal_mcore.rollout.engines import engine_for
from areal_mcore.rollout.engines.base import GroupSpec
from areal_mcore.rollout.engines.sglang import token_versions  # noqa: F401 (re-exported)
from areal_mcore.rollout.fleet import Server
from areal_mcore.rollout.protocol import RolloutError, SamplingParams  # noqa: F401 (RolloutError re-exported)

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class ClientConfig:
    addresses: list[str]
    request_timeout_s: float = 3600.0
    max_attempts: int = 4  # servers tried for one chunk before giving up
    retry_delay_s: float = 0.2
    api_key: str | None = None
    max_connections: int = 1024
    # Idle connections are dropped after this: uvicorn (vLLM's and SGLang's server) closes
    # idle keep-alive connections after 5 s, and a request sent on one it is closing fails
    # with "Connection reset by peer" (seen on /init_weight_transfer_engine after a pause).
    keepalive_s: float = 2.0
    backend: str = "sglang"  # the servers' engine (rollout.server.backend)
    stall_after_s: float = 300.0  # rollout.stall_after_s (see RolloutConfig)
    stall_probe_s: float = 30.0
    slow_factor: float = 10.0  # rollout.slow_request_factor (see RolloutConfig); 0: off
    min_deadline_s: float = 60.0  # rollout.min_request_deadline_s

    def __post_init__(self):
        engine_for(self.backend)  # raises ValueError naming the engines
        if not self.addresses:
            raise ValueError("rollout.client.addresses is empty: launch servers first")
        if self.max_attempts < 1:
            raise ValueError("rollout.client.max_attempts must be >= 1")


@dataclass
class Completion:
    rid: str
    input_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)  # weight version of each output token
    finish_reason: dict | None = None
    attempts: int = 0  # failed attempts (failovers) along the way


class _Retryable(Exception):
    pass


class RolloutClient:
    """Use as ``async with RolloutClient(cfg) as client:``."""

    def __init__(self, cfg: ClientConfig):
        self.cfg = cfg
        self.engine = engine_for(cfg.backend)
        self.servers = [Server(a) for a in cfg.addresses]
        self._cancelled: set[str] = set()
        self._wire: dict[str, tuple[Server, str]] = {}  # rid -> (server, wire rid) in flight
        self._background: set[asyncio.Task] = set()
        self._watchdog: asyncio.Task | None = None  # _watch_stalls
        self._session: aiohttp.ClientSession | None = None
        # group key -> the server its first sample went to (most recent groups only)
        self._affinity: OrderedDict[str, str] = OrderedDict()
        self._rates: deque[float] = deque(maxlen=256)  # tokens/s of recent finished attempts

    async def __aenter__(self) -> RolloutClient:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def start(self) -> None:
        headers = {"Authorization": f"Bearer {self.cfg.api_key}"} if self.cfg.api_key else {}
        self._session = aiohttp.ClientSession(
            headers=headers, connector=aiohttp.TCPConnector(limit=self.cfg.max_connections,
                                           keepalive_timeout=self.cfg.keepalive_s))
        await asyncio.gather(*[self._detect(s) for s in self.servers])
        self._watchdog = asyncio.ensure_future(self._watch_stalls())

    async def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            await asyncio.gather(self._watchdog, return_exceptions=True)
            self._watchdog = None
        for task in list(self._background):  # background aborts of timed-out requests
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _detect(self, s: Server) -> None:
        await self.engine.detect(self, s)

    # ---- generation --------------------------------------------------------------------
    async def generate(self, input_ids: list[int], sampling: SamplingParams, *,
                       rid: str | None = None, group: str | None = None) -> Completion:
        """One completion of ``input_ids``; see the module docstring for the guarantees.

        Calls with the same ``group`` go to the server the group's first call went to
        while it is healthy and untried for this call: a group's samples share the
        prompt, and only a server that holds it can reuse its KV (prefix caching).
        """
        c = Completion(rid=rid or uuid.uuid4().hex, input_ids=list(input_ids))
        failed: set[str] = set()
        for wire in itertools.count():
            if c.rid in self._cancelled:  # cancelled between two attempts
                self._cancelled.discard(c.rid)
                c.finish_reason = {"type": "abort", "message": "cancelled by the client"}
                return c
            remaining = sampling.max_new_tokens - len(c.output_ids)
            params = dataclasses.replace(
                sampling, max_new_tokens=remaining,
                min_new_tokens=max(0, sampling.min_new_tokens - len(c.output_ids)))
            server = await self._choose(failed, group)
            path, body = self.engine.generate_request(server, c.input_ids + c.output_ids,
                                                      params, f"{c.rid}.{wire}")
            if not server.in_flight:  # a busy period starts: so does its stall clock
                server.last_answer = time.monotonic()
            server.in_flight += 1
            self._wire[c.rid] = (server, f"{c.rid}.{wire}")
            sent = time.monotonic()
            attempt = asyncio.ensure_future(self._request(
                server, "POST", path, body, timeout=self.deadline(remaining), retryable=True,
                wire_rid=f"{c.rid}.{wire}"))
            server.attempts.add(attempt)
            try:
                try:
                    out = await attempt
                except asyncio.CancelledError:  # by _watch_stalls, or this call's own cancel
                    if not server.stalled or asyncio.current_task().cancelling():
                        raise
                    raise _Retryable("the server stalled") from None
                server.last_answer = time.monotonic()
            except _Retryable as e:
                c.attempts += 1
                failed.add(server.address)
                log.warning("rid %s failed on %s (%s); %d attempt(s) so far", c.rid,
                            server.address, e, c.attempts)
                if c.attempts >= self.cfg.max_attempts:
                    raise RolloutError(f"rid {c.rid}: {c.attempts} attempts failed, last on "
                                       f"{server.address}: {e}") from None
                await asyncio.sleep(self.cfg.retry_delay_s)
                continue
            finally:
                server.in_flight -= 1
                server.attempts.discard(attempt)
                self._wire.pop(c.rid, None)
            chunk = self.engine.parse_generate(server, out, remaining)
            if chunk.output_ids and chunk.finish_reason["type"] != "abort":
                self._rates.append(len(chunk.output_ids) / max(time.monotonic() - sent, 1e-3))
            c.output_ids += chunk.output_ids
            c.logprobs += chunk.logprobs
            c.versions += chunk.versions
            c.finish_reason = chunk.finish_reason
            if (c.finish_reason["type"] == "abort" and c.rid not in self._cancelled
                    and len(chunk.output_ids) < remaining):
                continue  # aborted by a pause or a weight update: resume where it stopped
            self._cancelled.discard(c.rid)
            return c
        raise AssertionError("unreachable")

    def deadline(self, tokens: int) -> float:
        """How long an attempt to generate up to ``tokens`` may take before it is retried
        elsewhere (a timeout: ``_request`` aborts it there): ``tokens`` at the floor rate,
        1/slow_factor of the median rate of the last attempts (queueing and prefill
        included), at least min_deadline_s; request_timeout_s until 16 are measured."""
        if not self.cfg.slow_factor or len(self._rates) < 16:
            return self.cfg.request_timeout_s
        floor = statistics.median(self._rates) / self.cfg.slow_factor
        return min(self.cfg.request_timeout_s, max(self.cfg.min_deadline_s, tokens / floor))

    async def _choose(self, failed: set[str], group: str | None = None) -> Server:
        """The group's server if it has one that is healthy and untried, else the healthy
        server with the fewest requests in flight, preferring untried ones."""
        if group is not None:
            address = self._affinity.get(group)
            pinned = [s for s in self.servers if s.address == address and s.healthy
                      and s.address not in failed]
            if pinned:
                self._affinity.move_to_end(group)
                return pinned[0]
        for _ in range(2):
            ok = [s for s in self.servers if s.healthy]
            fresh = [s for s in ok if s.address not in failed]
            if fresh or ok:
                chosen = min(fresh or ok, key=lambda s: s.in_flight)
                if group is not None:
                    self._affinity[group] = chosen.address
                    while len(self._affinity) > 65536:
                        self._affinity.popitem(last=False)
                return chosen
            await self.check_health()
        raise RolloutError(f"no healthy rollout server among {self.cfg.addresses}")

    async def _watch_stalls(self) -> None:
        """Marks stalled servers (see RolloutConfig.stall_after_s) unhealthy and sends their
        requests elsewhere: each in-flight attempt there is cancelled, and ``generate``
        retries it on another server (from what it generated, as after an abort)."""
        while True:
            await asyncio.sleep(min(10.0, self.cfg.stall_after_s / 2))
            for s in self.servers:
                quiet = time.monotonic() - s.last_answer
                if not (s.healthy and s.in_flight and quiet > self.cfg.stall_after_s):
                    continue
                if await self._answers_health(s, self.cfg.stall_probe_s):
                    s.last_answer = time.monotonic()  # alive: long generations, no answer yet
                    continue
                s.healthy, s.stalled = False, True
                log.warning("rollout server %s stalled: no answer for %.0f s and none to /health "
                            "within %.0f s; its %d request(s) go to the other servers", s.address,
                            quiet, self.cfg.stall_probe_s, s.in_flight)
                for attempt in list(s.attempts):
                    attempt.cancel()

    async def _answers_health(self, s: Server, timeout: float) -> bool:
        try:
            async with self._session.get(f"http://{s.address}/health",
                                         timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                return r.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False

    def stalled_servers(self) -> list[str]:
        return [s.address for s in self.servers if s.stalled]

    async def dead_servers(self, known: list[str] = ()) -> list[str]:
        """``known`` and the other servers a ``/health`` probe finds gone: a refused
        connection or an engine that says it is dead (a slow answer, a timeout or another
        HTTP error is not)."""
        async def probe(s: Server) -> bool:
            s.healthy = True  # _request sets it to False for a refused connection or a dead engine
            with contextlib.suppress(RolloutError):
                await self.request(s, "GET", "/health", timeout=30, parse=False)
            return s.healthy
        known = [s.address for s in self.servers if s.address in known]  # not those dropped already
        probed = [s for s in self.servers if s.address not in known]
        alive = await asyncio.gather(*[probe(s) for s in probed])
        return [*known, *(s.address for s, ok in zip(probed, alive, strict=True) if not ok)]

    def drop(self, addresses: list[str]) -> None:
        """Takes servers out of this client for good (dead ones the weight sync left behind:
        back at the same address they would serve old weights)."""
        self.servers = [s for s in self.servers if s.address not in addresses]
        for key in [k for k, a in self._affinity.items() if a in addresses]:
            del self._affinity[key]

    async def check_health(self) -> list[bool]:
        """Probes ``/health`` on every server and marks each healthy or not."""
        async def probe(s: Server) -> bool:
            try:
                # Within the stall probe's budget: with no healthy server left, generate's
                # last try waits on this twice before it gives up.
                await self._request(s, "GET", "/health", timeout=min(10.0, self.cfg.stall_probe_s), parse=False)
                s.healthy, s.stalled = True, False
            except RolloutError:
                s.healthy = False
            return s.healthy
        return list(await asyncio.gather(*[probe(s) for s in self.servers]))

    async def request(self, s: Server, method: str, path: str, body: dict | None = None, *,
                      timeout: float, parse: bool = True):
        """One call to one server (for engines); HTTP errors raise ``RolloutError``.

        Control calls go out on a connection of their own (``Connection: close``): uvicorn
        closes a keep-alive connection after an error response (vLLM answers 500 to a
        best-effort ``/finish_weight_update``), and the next call reusing it was reset
        ("Connection reset by peer" on ``/init_weight_transfer_engine``)."""
        return await self._request(s, method, path, body, timeout=timeout, parse=parse,
                                   close=True)

    async def _request(self, s: Server, method: str, path: str, body: dict | None = None, *,
                       timeout: float, retryable: bool = False, parse: bool = True,
                       wire_rid: str | None = None, close: bool = False):
        url = f"http://{s.address}{path}"
        headers = {"Connection": "close"} if close else None
        try:
            async with self._session.request(method, url, json=body, headers=headers,
                                             timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                text = await r.text()
                if r.status >= 400 and self.engine.dead_engine(r.status, text):
                    s.healthy = False  # e.g. vLLM's EngineDeadError: the server is gone
                    if retryable:
                        raise _Retryable(f"engine dead: HTTP {r.status}: {text[:200]}")
                if r.status >= 500 and retryable:
                    raise _Retryable(f"HTTP {r.status}: {text[:200]}")
                if r.status >= 400:
                    raise RolloutError(f"{s.address}{path}: HTTP {r.status}: {text[:500]}")
                if not parse or not text or r.content_type != "application/json":
                    return text  # e.g. flush_cache answers in plain text
                return await r.json()
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError) as e:
            s.healthy = isinstance(e, asyncio.TimeoutError)  # a timeout is slow, not dead
            if isinstance(e, asyncio.TimeoutError) and wire_rid is not None:
                # The server may still be generating it; free its slot there (the retry
                # goes out under a new wire rid, so it cannot collide with this one).
                task = asyncio.ensure_future(self._abort_on(s, wire_rid))
                self._background.add(task)
                task.add_done_callback(self._background.discard)
            if retryable:
                raise _Retryable(f"{type(e).__name__}: {e}") from None
            raise RolloutError(f"{s.address}{path}: {type(e).__name__}: {e}") from None

    async def _abort_on(self, s: Server, rid: str) -> None:
        try:
            await self.engine.abort(self, s, rid)
        except RolloutError:
            pass

    # ---- fleet control (the engine's protocol) -------------------------------------------
    async def all(self, method: str, path: str, body: dict | None = None, *,
                  servers: list[Server] | None = None, timeout: float = 600.0,
                  fail_fast: bool = False) -> list:
        """The same call on every server (by default those not found stalled: they answer
        nothing, and waiting on them is what the watchdog is for), concurrently; every
        failure is reported (``fail_fast``: those up to the first, see ``each``)."""
        servers = [s for s in self.servers if not s.stalled] if servers is None else servers
        return await self.each(servers, [self._request(s, method, path, body, timeout=timeout,
                                                       close=True) for s in servers],
                               fail_fast=fail_fast)

    @staticmethod
    async def each(servers: list[Server], calls: list, *, fail_fast: bool = False) -> list:
        """Awaits one call per server; raises one RolloutError naming every server that
        failed. ``fail_fast``: the first failure cancels the calls still running (a weight
        bucket: the other servers answer only after a broadcast that cannot complete)."""
        tasks = [asyncio.ensure_future(c) for c in calls]
        if fail_fast and tasks:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for t in tasks:
                t.cancel()  # a no-op on the finished ones
        out = await asyncio.gather(*tasks, return_exceptions=True)
        failed = [(s, e) for s, e in zip(servers, out)
                  if isinstance(e, BaseException) and not isinstance(e, asyncio.CancelledError)]
        if failed:
            cancelled = sum(isinstance(e, asyncio.CancelledError) for e in out)
            note = f" ({cancelled} other server(s)' calls cancelled)" if cancelled else ""
            raise RolloutError("; ".join(str(e) for _, e in failed) + note,
                               [s.address for s, _ in failed])
        return list(out)

    async def abort(self, rid: str) -> None:
        """Cancels one request; ``generate`` then returns it as aborted."""
        self._cancelled.add(rid)
        if rid in self._wire:
            server, wire = self._wire[rid]
            await self.engine.abort(self, server, wire)

    async def abort_all(self) -> None:
        await self.engine.abort_all(self)

    async def pause(self, mode: str = "abort") -> None:
        await self.engine.pause(self, mode)

    async def continue_(self) -> None:
        await self.engine.resume(self)

    async def flush_cache(self) -> None:
        await self.engine.flush_cache(self)

    async def weight_versions(self) -> list[str]:
        """Every server's weight version."""
        return await self.engine.weight_versions(self)

    def weight_group_world_size(self) -> int:
        return self.engine.group_world_size(self)

    def check_distributed_updates(self, pp_size: int = 1) -> None:
        self.engine.check_distributed_updates(self, pp_size)

    def group_spec(self, *, master_address: str, master_port: int, group_name: str,
                   backend: str, stage: int = 0) -> GroupSpec:
        """The group of one stage: trainer rank 0, each server's TP ranks after it."""
        offsets, off = [], 1
        for s in self.servers:
            offsets.append(off)
            off += s.tp_size
        return GroupSpec(master_address=master_address, master_port=master_port,
                         group_name=group_name, backend=backend, stage=stage,
                         rank_offsets=offsets, world_size=self.weight_group_world_size())

    async def destroy_weights_update_group(self, group_name: str, *, backend: str) -> None:
        await self.engine.destroy_group(self, group_name, backend)

    async def begin_update(self, pause_mode: str) -> None:
        """Pauses generation and opens an update session on every server."""
        await self.engine.begin_update(self, pause_mode)

    async def finish_update(self, pause_mode: str, version: str) -> None:
        """Closes the session, makes the servers report ``version`` and resumes them."""
        await self.engine.finish_update(self, pause_mode, version)

    async def end_weight_update(self, *, best_effort: bool = False) -> None:
        """Closes the update session. ``best_effort``: on every server, ignoring refusals
        (a server without an open session says so), to leave no session open after a
        failure or one left by a trainer that died mid-update."""
        await self.engine.end_update(self, best_effort=best_effort)

    async def update_bucket(self, *, names: list[str], dtypes: list[str],
                            shapes: list[list[int]], group: GroupSpec, flatten: bool,
                            weight_version: str | None = None) -> None:
        await self.engine.update_bucket(self, names=names, dtypes=dtypes, shapes=shapes,
                                        group=group, flatten=flatten,
                                        weight_version=weight_version)

    async def update_weights_from_disk(self, model_path: str, *,
                                       weight_version: str | None = None,
                                       pause_mode: str | None = None) -> None:
        """Loads an HF export; with ``pause_mode``, paused around it."""
        if pause_mode is None:
            await self.all("POST", "/update_weights_from_disk",
                           {"model_path": model_path, "weight_version": weight_version})
            return
        await self.engine.update_from_disk(self, model_path, str(weight_version), pause_mode)
