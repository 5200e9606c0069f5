"""Async client for a fleet of SGLang (or embedded) servers.

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
import dataclasses
import itertools
import logging
import uuid
from dataclasses import dataclass, field

import aiohttp

from areal_mcore.rollout.protocol import LAST_OLD_API, SamplingParams, parse_version

log = logging.getLogger(__name__)


class RolloutError(RuntimeError):
    """A request that no server could serve, or servers that refused an admin call
    (``failed`` lists their addresses)."""

    def __init__(self, message: str, failed: list[str] | None = None):
        super().__init__(message)
        self.failed = failed or []


@dataclass(kw_only=True)
class ClientConfig:
    addresses: list[str]
    request_timeout_s: float = 3600.0
    max_attempts: int = 4  # servers tried for one chunk before giving up
    retry_delay_s: float = 0.2
    api_key: str | None = None
    max_connections: int = 1024

    def __post_init__(self):
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


@dataclass
class _Server:
    address: str
    in_flight: int = 0
    healthy: bool = True
    version: tuple[int, ...] = ()
    tp_size: int = 1
    dp_size: int = 1
    pp_size: int = 1

    @property
    def old_api(self) -> bool:
        # (0, 0, 0) is an SGLang built from source without metadata ("0.0.0.dev0"): new.
        return (0, 0, 0) < self.version <= LAST_OLD_API


class _Retryable(Exception):
    pass


class RolloutClient:
    """Use as ``async with RolloutClient(cfg) as client:``."""

    def __init__(self, cfg: ClientConfig):
        self.cfg = cfg
        self.servers = [_Server(a) for a in cfg.addresses]
        self._cancelled: set[str] = set()
        self._wire: dict[str, tuple[_Server, str]] = {}  # rid -> (server, wire rid) in flight
        self._background: set[asyncio.Task] = set()
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> RolloutClient:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def start(self) -> None:
        headers = {"Authorization": f"Bearer {self.cfg.api_key}"} if self.cfg.api_key else {}
        self._session = aiohttp.ClientSession(
            headers=headers, connector=aiohttp.TCPConnector(limit=self.cfg.max_connections))
        await asyncio.gather(*[self._detect(s) for s in self.servers])

    async def close(self) -> None:
        for task in list(self._background):  # background aborts of timed-out requests
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _detect(self, s: _Server) -> None:
        """Version and parallel sizes from /server_info (SGLang 0.5.10-0.5.23 all serve it;
        /get_server_info is its deprecated alias)."""
        for path in ("/server_info", "/get_server_info"):
            try:
                info = await self._request(s, "GET", path, timeout=30)
            except RolloutError:
                continue
            s.version = parse_version(str(info.get("version", "")))
            s.tp_size, s.dp_size, s.pp_size = (int(info.get(k) or 1)
                                               for k in ("tp_size", "dp_size", "pp_size"))
            return
        raise RolloutError(f"{s.address}: neither /server_info nor /get_server_info answered")

    # ---- generation --------------------------------------------------------------------
    async def generate(self, input_ids: list[int], sampling: SamplingParams, *,
                       rid: str | None = None) -> Completion:
        """One completion of ``input_ids``; see the module docstring for the guarantees."""
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
            body = {"input_ids": c.input_ids + c.output_ids, "sampling_params": params.to_json(),
                    "return_logprob": True, "rid": f"{c.rid}.{wire}"}
            server = await self._choose(failed)
            server.in_flight += 1
            self._wire[c.rid] = (server, body["rid"])
            try:
                out = await self._request(server, "POST", "/generate", body,
                                          timeout=self.cfg.request_timeout_s, retryable=True)
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
                self._wire.pop(c.rid, None)
            meta = out["meta_info"]
            chunk = out["output_ids"]
            c.output_ids += chunk
            c.logprobs += [lp for lp, _, _ in meta.get("output_token_logprobs", [])]
            c.versions += token_versions(meta, len(chunk))
            c.finish_reason = meta["finish_reason"]
            if (c.finish_reason["type"] == "abort" and c.rid not in self._cancelled
                    and len(chunk) < remaining):
                continue  # aborted by a pause or a weight update: resume where it stopped
            self._cancelled.discard(c.rid)
            return c
        raise AssertionError("unreachable")

    async def _choose(self, failed: set[str]) -> _Server:
        """The healthy server with the fewest requests in flight, preferring untried ones."""
        for _ in range(2):
            ok = [s for s in self.servers if s.healthy]
            fresh = [s for s in ok if s.address not in failed]
            if fresh or ok:
                return min(fresh or ok, key=lambda s: s.in_flight)
            await self.check_health()
        raise RolloutError(f"no healthy rollout server among {self.cfg.addresses}")

    async def check_health(self) -> list[bool]:
        """Probes ``/health`` on every server and marks each healthy or not."""
        async def probe(s: _Server) -> bool:
            try:
                await self._request(s, "GET", "/health", timeout=10, parse=False)
                s.healthy = True
            except RolloutError:
                s.healthy = False
            return s.healthy
        return list(await asyncio.gather(*[probe(s) for s in self.servers]))

    async def _request(self, s: _Server, method: str, path: str, body: dict | None = None, *,
                       timeout: float, retryable: bool = False, parse: bool = True):
        url = f"http://{s.address}{path}"
        try:
            async with self._session.request(method, url, json=body,
                                             timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                text = await r.text()
                if r.status >= 500 and retryable:
                    raise _Retryable(f"HTTP {r.status}: {text[:200]}")
                if r.status >= 400:
                    raise RolloutError(f"{s.address}{path}: HTTP {r.status}: {text[:500]}")
                if not parse or not text or r.content_type != "application/json":
                    return text  # e.g. flush_cache answers in plain text
                return await r.json()
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError) as e:
            s.healthy = isinstance(e, asyncio.TimeoutError)  # a timeout is slow, not dead
            if isinstance(e, asyncio.TimeoutError) and path == "/generate" and body:
                # The server may still be generating it; free its slot there (the retry
                # goes out under a new wire rid, so it cannot collide with this one).
                task = asyncio.ensure_future(self._abort_on(s, body["rid"]))
                self._background.add(task)
                task.add_done_callback(self._background.discard)
            if retryable:
                raise _Retryable(f"{type(e).__name__}: {e}") from None
            raise RolloutError(f"{s.address}{path}: {type(e).__name__}: {e}") from None

    async def _abort_on(self, s: _Server, rid: str) -> None:
        try:
            await self._request(s, "POST", "/abort_request", {"rid": rid}, timeout=10)
        except RolloutError:
            pass

    # ---- fleet control -----------------------------------------------------------------
    async def _all(self, method: str, path: str, body: dict | None = None, *,
                   servers: list[_Server] | None = None, timeout: float = 600.0) -> list:
        """The same call on every server, concurrently; every failure is reported."""
        servers = self.servers if servers is None else servers
        return await self._each(servers, [self._request(s, method, path, body, timeout=timeout)
                                          for s in servers])

    @staticmethod
    async def _each(servers: list[_Server], calls: list) -> list:
        """Awaits one call per server; raises one RolloutError naming every server that failed."""
        out = await asyncio.gather(*calls, return_exceptions=True)
        failed = [(s, e) for s, e in zip(servers, out) if isinstance(e, BaseException)]
        if failed:
            raise RolloutError("; ".join(str(e) for _, e in failed), [s.address for s, _ in failed])
        return list(out)

    async def abort(self, rid: str) -> None:
        """Cancels one request; ``generate`` then returns it as aborted."""
        self._cancelled.add(rid)
        if rid in self._wire:
            server, wire = self._wire[rid]
            await self._all("POST", "/abort_request", {"rid": wire}, servers=[server])

    async def abort_all(self) -> None:
        await self._all("POST", "/abort_request", {"abort_all": True})

    async def pause(self, mode: str = "abort") -> None:
        await self._all("POST", "/pause_generation", {"mode": mode})

    async def continue_(self) -> None:
        await self._all("POST", "/continue_generation", {})

    async def flush_cache(self) -> None:
        await self._all("POST", "/flush_cache")

    async def weight_versions(self) -> list[str]:
        """Every server's version, from /model_info (on every SGLang version)."""
        infos = await self._all("GET", "/model_info", timeout=30)
        return [str(info["weight_version"]) for info in infos]

    def weight_group_world_size(self) -> int:
        """Trainer rank 0 plus every server's TP ranks."""
        return 1 + sum(s.tp_size for s in self.servers)

    def check_distributed_updates(self) -> None:
        """SGLang's ``update_weights_from_distributed`` asserts ``dp_size == 1`` and joins
        TP rank r as ``rank_offset + r``: PP stages would take the same ranks."""
        bad = [f"{s.address} (dp_size={s.dp_size}, pp_size={s.pp_size})"
               for s in self.servers if s.dp_size != 1 or s.pp_size != 1]
        if bad:
            raise RolloutError(
                "SGLang cannot receive update_weights_from_distributed on servers with "
                f"dp_size or pp_size > 1: {', '.join(bad)}; launch one server per data-parallel "
                "replica (rollout.server.n_servers) with tp_size only, or use "
                "weight_sync.mode=disk", [s.address for s in self.servers if s.dp_size != 1
                                          or s.pp_size != 1])

    async def init_weights_update_group(self, *, master_address: str, master_port: int,
                                        group_name: str, backend: str) -> None:
        """Blocks until every server joined; the trainer must join as rank 0 concurrently."""
        offsets, off = [], 1
        for s in self.servers:
            offsets.append(off)
            off += s.tp_size
        world = self.weight_group_world_size()
        await self._each(self.servers, [self._request(s, "POST", "/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": o,
            "world_size": world, "group_name": group_name, "backend": backend}, timeout=600)
            for s, o in zip(self.servers, offsets)])

    async def destroy_weights_update_group(self, group_name: str) -> None:
        await self._all("POST", "/destroy_weights_update_group", {"group_name": group_name})

    async def begin_weight_update(self) -> None:
        await self._all("POST", "/begin_weight_update", {},
                        servers=[s for s in self.servers if not s.old_api])

    async def end_weight_update(self, *, best_effort: bool = False) -> None:
        """Closes the update session. ``best_effort``: on every server, ignoring refusals
        (a server without an open session says so), to leave no session open after a
        failure or one left by a trainer that died mid-update."""
        servers = [s for s in self.servers if not s.old_api]
        if not best_effort:
            await self._all("POST", "/end_weight_update", {}, servers=servers)
            return
        await asyncio.gather(*[self._request(s, "POST", "/end_weight_update", {}, timeout=60)
                               for s in servers], return_exceptions=True)

    async def update_weights_from_distributed(self, *, names: list[str], dtypes: list[str],
                                              shapes: list[list[int]], group_name: str,
                                              weight_version: str | None = None,
                                              flush_cache: bool = True,
                                              load_format: str | None = None) -> None:
        """Servers allocate and receive by ``broadcast(src=0)``; the trainer sends meanwhile.
        ``load_format="flattened_bucket"``: one broadcast of the tensors back to back."""
        await self._all("POST", "/update_weights_from_distributed", {
            "names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
            "flush_cache": flush_cache, "weight_version": weight_version,
            "load_format": load_format})

    async def update_weights_from_disk(self, model_path: str, *,
                                       weight_version: str | None = None) -> None:
        await self._all("POST", "/update_weights_from_disk",
                        {"model_path": model_path, "weight_version": weight_version})


def token_versions(meta: dict, n: int) -> list[str]:
    """The weight version of each of a response's ``n`` output tokens: SGLang's
    ``weight_versions`` spans when present, else the response's ``weight_version``."""
    spans = meta.get("weight_versions")
    if not spans:
        return [str(meta.get("weight_version"))] * n
    out: list[str] = []
    for span in spans:
        out += [str(span["version"])] * (min(span["end"], n) - span["start"])
    return out + [str(spans[-1]["version"])] * (n - len(out))
