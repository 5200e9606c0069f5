"""The rollout servers as one fleet: their list, calls to one or all of them, health, and
the bookkeeping of which are stalled or gone. Engine adapters (``rollout/engines/``) speak
through it; the rollout client (generation) and the weight syncer (updates) use it, and on
the trainer's rank 0 they share one, so a server either of them finds gone is gone for
both. Imports run one way: client / syncer -> engines -> fleet (``tests/test_layering.py``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import resource
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from areal_mcore.net import listens_within
from areal_mcore.rollout.protocol import LAST_OLD_API, RolloutError


@dataclass
class Server:
    """One server as the fleet tracks it (the adapters read and set the engine's facts)."""

    address: str
    in_flight: int = 0
    healthy: bool = True
    version: tuple[int, ...] = ()
    tp_size: int = 1
    dp_size: int = 1
    pp_size: int = 1
    last_answer: float = 0.0  # monotonic time of its last completion (or busy period's start)
    stalled: bool = False
    # Taken out for bad answers (the client's ``max_bad_answers``): out of generation for
    # good, and dropped by the next weight push (``gone_servers``); ``fault``: the last one.
    faulty: bool = False
    fault: str = ""
    answers: int = 0  # generate answers read, good and bad (the client counts them)
    bad_at: list = dataclasses.field(default_factory=list)  # ``answers`` at each bad one, recent
    attempts: set = dataclasses.field(default_factory=set)  # generate attempts in flight
    # The process we launched it as (rollout/servers.py); None: a server someone else runs.
    # A probe finds it gone once that process no longer holds the port, whoever answers there.
    owner_pid: int | None = None

    @property
    def old_api(self) -> bool:
        # (0, 0, 0) is an SGLang built from source without metadata ("0.0.0.dev0"): new.
        return (0, 0, 0) < self.version <= LAST_OLD_API


class TransientError(RolloutError):
    """A call that another server (or a later try) may serve: a 5xx, a lost connection,
    a timeout (``timed_out``: the server may still be working on it), a gone server
    (``gone``: a refused connection or an engine that says it is dead)."""

    def __init__(self, message: str, failed: list[str], *, timed_out: bool = False,
                 gone: bool = False):
        super().__init__(message, failed)
        self.timed_out, self.gone = timed_out, gone


class BadAnswer(TransientError):
    """A 2xx answer that breaks the engine's contract: not JSON, a missing or mistyped
    field, token ids outside the served vocabulary, logprobs that do not match the tokens
    (``Engine.read_generate``). A server fault, as a 5xx is: another server may serve it."""


# What a /health probe found: answered 200, answered otherwise (alive but busy), nothing
# within its timeout (a stopped or hung process: /health answers from the HTTP server's own
# loop on every engine, see ``Fleet.request``), or gone (a refused connection, an engine
# that says it is dead, its port taken over).
OK, SLOW, SILENT, GONE = "ok", "slow", "silent", "gone"


def _allow_open_files(connections: int) -> None:
    """Raises this process's soft open-file limit towards ``connections`` + a margin: each
    connection is a file descriptor, and a common soft limit (1,024) is below a boba-scale
    client's requests in flight (4,096), where ``connect`` would fail with EMFILE."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = connections + 1024  # control calls, the reward workers' pipes, logs, checkpoints
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))


class Fleet:
    """Use ``await fleet.start()`` / ``await fleet.close()`` (or ``async with``).

    Two connection pools: generation's, capped at ``max_connections`` (0: uncapped), and
    control calls' (pause, weight updates, health), uncapped and one connection per call. A weight update
    with pause mode ``in_place`` keeps every generate request open, so a capped pool full
    of them would never free a connection for the update that ends their pause. One
    connection per control call: uvicorn closes a keep-alive connection after an error
    response (vLLM answers 500 to a best-effort ``/finish_weight_update``), and the next
    call reusing it was reset ("Connection reset by peer" on ``/init_weight_transfer_engine``).
    """

    def __init__(self, addresses: list[str], *, api_key: str | None = None,
                 max_connections: int = 0, keepalive_s: float = 2.0,
                 dead_engine: Callable[[int, str], bool] = lambda status, text: False):
        if not addresses:
            raise ValueError("rollout.client.addresses is empty: launch servers first")
        self.servers = [Server(a) for a in addresses]
        self.api_key, self.max_connections, self.keepalive_s = api_key, max_connections, keepalive_s
        self.dead_engine = dead_engine  # the engine's: an HTTP error that means it is gone
        # Control calls are watched for stalls (``request``) when set: the client sets them
        # from rollout.stall_after_s / stall_probe_s.
        self.stall_after_s: float | None = None
        self.stall_probe_s: float = 30.0
        self._generation: aiohttp.ClientSession | None = None
        self._control: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Fleet:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def start(self) -> None:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        _allow_open_files(self.max_connections or 4 * 1024)
        # uvicorn (vLLM's and SGLang's server) closes idle keep-alive connections after
        # 5 s; one it is closing fails a request sent on it: idle ones go after keepalive_s.
        self._generation = aiohttp.ClientSession(headers=headers, connector=aiohttp.TCPConnector(
            limit=self.max_connections, keepalive_timeout=self.keepalive_s))
        self._control = aiohttp.ClientSession(headers=headers, connector=aiohttp.TCPConnector(
            limit=0, force_close=True))

    async def close(self) -> None:
        for session in (self._generation, self._control):
            if session is not None:
                await session.close()
        self._generation = self._control = None

    # ---- calls -------------------------------------------------------------------------
    async def request(self, s: Server, method: str, path: str, body: dict | None = None, *,
                      timeout: float, parse: bool = True, control: bool = True):
        """One call to one server (``_request``). A control call that may outlast
        ``stall_after_s`` is watched: a server that has not answered it by then and does
        not answer /health within ``stall_probe_s`` either is stalled (a SIGSTOPped or hung
        engine: its socket accepts, nothing answers), and the call fails as if it were gone,
        instead of waiting out its timeout (600 s for a pause, with /health never asked).
        /health answers from the HTTP server's own loop on every engine (SGLang's returns
        200 at once unless SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION, http_server.py
        ``health_generate``), so a long weight load does not look stalled."""
        call = self._request(s, method, path, body, timeout=timeout, parse=parse, control=control)
        if not (control and self.stall_after_s and timeout > self.stall_after_s and path != "/health"):
            return await call
        task = asyncio.ensure_future(call)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.stall_after_s)
                if done:
                    return task.result()
                if await self.probe(s, self.stall_probe_s) != OK:
                    self.mark_stalled(s)
                    raise TransientError(f"{s.address}{path}: no answer for {self.stall_after_s:g} s and "
                                         f"none to /health within {self.stall_probe_s:g} s: stalled",
                                         [s.address], gone=True)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _request(self, s: Server, method: str, path: str, body: dict | None = None, *,
                       timeout: float, parse: bool = True, control: bool = True):
        """One call to one server. Errors raise ``RolloutError``, ``TransientError`` for
        those another try may not meet; a refused connection or a dead engine marks the
        server unhealthy (a timeout does not: slow is not gone)."""
        session = self._control if control else self._generation
        try:
            async with session.request(method, f"http://{s.address}{path}", json=body,
                                       timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                # errors="replace": bytes that are not UTF-8 must not raise a UnicodeDecodeError
                # (a ValueError: a user error to the CLI); JSON with them fails below.
                text = await r.text(errors="replace")
                if r.status >= 400 and self.dead_engine(r.status, text):
                    s.healthy = False  # e.g. vLLM's EngineDeadError
                    raise TransientError(f"{s.address}{path}: engine dead: HTTP {r.status}: "
                                         f"{text[:200]}", [s.address], gone=True)
                if r.status >= 400:
                    kind = TransientError if r.status >= 500 else RolloutError
                    raise kind(f"{s.address}{path}: HTTP {r.status}: {text[:500]}", [s.address])
                if not parse or not text or r.content_type != "application/json":
                    return text  # e.g. flush_cache answers in plain text
                try:
                    return json.loads(text)  # r.json() would decode the body a second time
                except ValueError as e:  # a JSONDecodeError must not pass for a user error
                    raise BadAnswer(f"{s.address}{path}: HTTP {r.status} with a body that is not "
                                    f"JSON ({e}): {text[:200]!r}", [s.address]) from None
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError) as e:
            timed_out = isinstance(e, asyncio.TimeoutError)
            s.healthy = timed_out
            raise TransientError(f"{s.address}{path}: {type(e).__name__}: {e}", [s.address],
                                 timed_out=timed_out, gone=not timed_out) from None

    async def all(self, method: str, path: str, body: dict | None = None, *,
                  servers: list[Server] | None = None, timeout: float = 600.0,
                  fail_fast: bool = False) -> list:
        """The same call on every server (by default those not found stalled: they answer
        nothing, and waiting on them is what the client's watchdog is for; nor faulty: out
        of generation, their next weight push drops them), concurrently; every failure is
        reported (``fail_fast``: those up to the first, see ``each``)."""
        servers = self.reachable() if servers is None else servers
        return await self.each(servers, [self.request(s, method, path, body, timeout=timeout)
                                         for s in servers], fail_fast=fail_fast)

    def reachable(self) -> list[Server]:
        """The servers ``all`` calls by default: neither stalled nor faulty."""
        return [s for s in self.servers if not (s.stalled or s.faulty)]

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

    # ---- health ------------------------------------------------------------------------
    async def probe(self, s: Server, timeout: float) -> str:
        """``OK``, ``SLOW``, ``SILENT`` or ``GONE`` (see above); marks a gone server unhealthy only.
        A launched server whose port another process holds now is gone: that one would
        answer /health, and get our requests and weights."""
        if s.owner_pid is not None and not await asyncio.to_thread(listens_within, s.owner_pid, _port(s)):
            s.healthy = False
            return GONE
        try:
            await self.request(s, "GET", "/health", timeout=timeout, parse=False)
            return OK
        except RolloutError as e:
            return GONE if getattr(e, "gone", False) else SILENT if getattr(e, "timed_out", False) else SLOW

    async def check_health(self, timeout: float = 10.0) -> list[bool]:
        """Probes every server; those that answer are healthy (and no longer stalled), but
        for faulty ones: a server that answered /generate wrongly answers /health all the same."""
        found = await asyncio.gather(*[self.probe(s, timeout) for s in self.servers])
        for s, f in zip(self.servers, found, strict=True):
            s.healthy = f == OK and not s.faulty
            s.stalled = s.stalled and not s.healthy
        return [f == OK for f in found]

    @staticmethod
    def mark_stalled(s: Server) -> None:
        """Out of generation until it answers /health again (``check_health``); its
        generate attempts in flight are cancelled, and the client retries each elsewhere
        (``RolloutClient.generate``: a cancelled attempt on a stalled server is retried).
        Whoever finds the stall (the client's watchdog, a watched control call, the weight
        push's probe), the requests stuck there move: they waited for the watchdog, which
        skips a server once it is unhealthy."""
        s.healthy, s.stalled = False, True
        for attempt in list(s.attempts):
            attempt.cancel()

    def stalled_servers(self) -> list[str]:
        return [s.address for s in self.servers if s.stalled]

    def faulty_servers(self) -> list[str]:
        return [s.address for s in self.servers if s.faulty]

    async def gone_servers(self) -> list[str]:
        """The stalled servers (a pause would wait on them), the faulty ones (taken out of
        generation for bad answers: they get no weights either) and those a ``/health``
        probe finds gone or silent for ``stall_probe_s`` (stalled now: an HTTP error
        answer is not). A server stopped since the rollout last heard from it is found
        here, before the push: the pause waited on it (``request``'s watch) and then the
        push was done again, 102 s for a SIGSTOP between two async steps."""
        probed = [s for s in self.servers if not (s.stalled or s.faulty)]
        found = await asyncio.gather(*[self.probe(s, self.stall_probe_s) for s in probed])
        for s, f in zip(probed, found, strict=True):
            if f == SILENT:
                self.mark_stalled(s)
        return [*(s.address for s in self.servers if s.stalled or s.faulty),
                *(s.address for s, f in zip(probed, found, strict=True) if f == GONE)]

    def drop(self, addresses: list[str]) -> None:
        """Takes servers out of the fleet for good (gone ones the weight sync left behind:
        back at the same address they would serve old weights)."""
        self.servers = [s for s in self.servers if s.address not in addresses]


def _port(s: Server) -> int:
    return int(s.address.rsplit(":", 1)[1])
