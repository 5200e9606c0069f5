"""Async client for a fleet of rollout servers (SGLang, vLLM or embedded).

The engine's protocol (request/response translation, pause/abort, weight updates) comes
from ``rollout/engines/``; this module is the part every engine shares.

``generate`` sends token ids to the least-loaded healthy server and fails over to another
on connection errors, timeouts, 5xx and bad answers, keeping the request id: each call
returns exactly one completion. Every answer is checked against the engine's contract
(``Engine.read_generate``: JSON of the engine's shape, token ids in the served vocabulary,
one finite logprob per token); a server that gives ``max_bad_answers`` bad ones within
``BAD_ANSWER_WINDOW`` of its answers is faulty: out of generation for good, and the next
weight push drops it (``Fleet.gone_servers``). A completion aborted by
``pause_generation`` or a weight update is resubmitted with what it has generated so far
(the server holds it until ``continue_generation``), and each token remembers the weight
version that produced it (SGLang's ``meta_info.weight_versions`` spans where the server
reports them). Every HTTP
attempt carries a fresh wire rid (``<rid>.<attempt>``): a retried request never collides
with its own earlier attempt whose abort has not finished ("Duplicate request ID").
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import gc
import itertools
import logging
import os
import statistics
import time
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import numpy as np

from areal_mcore.rollout.engines import engine_for
from areal_mcore.rollout.fleet import OK, BadAnswer, Fleet, Server, TransientError
from areal_mcore.rollout.protocol import RolloutError, SamplingParams

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class ClientConfig:
    addresses: list[str]
    request_timeout_s: float = 3600.0
    max_attempts: int = 4  # servers tried for one chunk before giving up
    retry_delay_s: float = 0.2
    api_key: str | None = None
    # Generation connections, one per request in flight; 0: no cap (the caller bounds its
    # requests: the trainer passes rollout.max_connections, eval its own concurrency).
    max_connections: int = 0
    # Idle connections are dropped after this: uvicorn (vLLM's and SGLang's server) closes
    # idle keep-alive connections after 5 s, and a request sent on one it is closing fails
    # with "Connection reset by peer" (seen on /init_weight_transfer_engine after a pause).
    keepalive_s: float = 2.0
    backend: str = "sglang"  # the servers' engine (rollout.server.backend)
    # Ask for each completion's MoE routing (servers started with server.return_routed_experts).
    return_routed_experts: bool = False
    stall_after_s: float = 300.0  # rollout.stall_after_s (see RolloutConfig)
    stall_probe_s: float = 30.0
    slow_factor: float = 10.0  # rollout.slow_request_factor (see RolloutConfig); 0: off
    min_deadline_s: float = 60.0  # rollout.min_request_deadline_s
    # The served model's vocabulary (its HF config's vocab_size: served_vocab_size): an
    # answer with a token id outside [0, vocab_size) is a bad answer. None: unchecked,
    # where no model is known (a stand-in server in a unit test).
    vocab_size: int | None = None
    max_bad_answers: int = 3  # rollout.max_bad_answers (see RolloutConfig)

    @classmethod
    def from_sections(cls, rollout, server, *, addresses: list[str], api_key: str | None,
                      max_connections: int | None = None, model_path: str | None = None,
                      routed_experts: bool = False) -> ClientConfig:
        """The client of ``server``'s fleet (a ``ServerConfig``: engine, the served model's
        vocabulary, from ``server.model_path`` else ``model_path``) with ``rollout``'s
        request policy (a ``RolloutConfig``: stall detection, per-request deadlines, bad
        answers; its connection limit unless ``max_connections``). ``routed_experts``: ask
        for the MoE routing (``server.return_routed_experts``), which only training replays.
        The one place a client is configured: the trainer, eval and the difficulty filter
        each used to copy a different subset of these fields by hand, so eval's clients ran
        on the defaults whatever the config said."""
        return cls(addresses=list(addresses), api_key=api_key, backend=server.backend,
                   max_connections=rollout.connections if max_connections is None else max_connections,
                   stall_after_s=rollout.stall_after_s, stall_probe_s=rollout.stall_probe_s,
                   slow_factor=rollout.slow_request_factor, min_deadline_s=rollout.min_request_deadline_s,
                   max_bad_answers=rollout.max_bad_answers,
                   vocab_size=served_vocab_size(server.model_path or model_path),
                   return_routed_experts=routed_experts)

    def __post_init__(self):
        engine_for(self.backend)  # raises ValueError naming the engines
        if not self.addresses:
            raise ValueError("rollout.client.addresses is empty: launch servers first")
        if self.max_attempts < 1:
            raise ValueError("rollout.client.max_attempts must be >= 1")
        if self.max_bad_answers < 1:
            raise ValueError(f"max_bad_answers={self.max_bad_answers} must be >= 1")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ValueError(f"vocab_size={self.vocab_size} must be >= 1 (None: unchecked)")
        if self.max_connections < 0:
            raise ValueError(f"max_connections={self.max_connections} must be >= 0 (0: no cap)")


@dataclass
class Completion:
    rid: str
    input_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)  # weight version of each output token
    finish_reason: dict | None = None
    attempts: int = 0  # failed attempts (failovers) along the way
    # MoE routing of input + output tokens but the last (Chunk.routed_experts); None when not
    # asked for, or when an attempt that generated tokens returned none (it would have gaps)
    routed_experts: np.ndarray | None = None


class _Retryable(Exception):
    pass


# A server is faulty after max_bad_answers bad answers among its last BAD_ANSWER_WINDOW:
# an honest server gives none, while a rare glitch (one bad answer an hour) stays a retry.
BAD_ANSWER_WINDOW = 100


def served_vocab_size(model_path: str | None) -> int | None:
    """The vocabulary of the model the servers serve: its HF config's ``vocab_size``
    (the text model's, for a config that nests one), the rows of its logits and so the
    ids it can sample; None without a model path. Megatron pads the trainer's vocabulary
    beyond it; an id in the gap would train on a row no tokenizer has.

    None also for a path that is no local folder (a hub id the servers resolve
    themselves): the client looks nothing up over the network."""
    if model_path is None or not os.path.isdir(model_path):
        return None
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(model_path, local_files_only=True)
    size = getattr(hf, "vocab_size", None) or getattr(getattr(hf, "text_config", None), "vocab_size", None)
    return int(size) if size else None


GC_THRESHOLD = 50_000


def relax_gc() -> None:
    """For a process whose event loop runs a client at scale (the trainer's rank 0, eval).

    Python's cyclic GC at its default gen-0 threshold (700 new container objects) runs
    several collections per response (each token's logprob arrives as a JSON list), and
    with thousands of requests in flight their objects survive into the old generations,
    which the collector then walks again and again: in bench/rollout_fleet.py at 4,096
    requests in flight the client spent ~3 ms of GC per response, its event loop saturated
    and the servers ran at 28 % of their concurrency (99 % with this). Objects alive now
    (modules, the model) are frozen out of the collector's walks; collections stay, 70x
    rarer. Process-wide, so the caller decides (the client itself does not).

    The frozen objects go back to the collector at exit (``gc.unfreeze`` from ``atexit``,
    which runs before the interpreter tears modules down). Frozen objects are never
    collected, not even by the collections of ``Py_FinalizeEx`` (CPython's
    ``_PyGC_CollectNoFail``, Python/gcmodule.c, collects the generations, not the permanent
    one), so every reference cycle alive at the freeze would outlive the interpreter:
    among them those of triton's nanobind extension (``triton._C.libtriton``: its modules
    and the types and functions they hold refer to each other), which nanobind then reports
    at exit as ~30 lines of "nanobind: leaked 4 instances / 64 types / 514 functions"
    (``python -c "from triton._C import libtriton; import gc; gc.freeze()"`` shows it)."""
    if gc.get_threshold()[0] < GC_THRESHOLD:
        gc.freeze()
        gc.set_threshold(GC_THRESHOLD, 20, 20)
        atexit.unregister(gc.unfreeze)  # once, however often this runs
        atexit.register(gc.unfreeze)


class RolloutClient:
    """Use as ``async with RolloutClient(cfg) as client:``. ``fleet``: servers to share
    (the trainer's weight syncer uses the same), else the client makes its own from ``cfg``."""

    def __init__(self, cfg: ClientConfig, fleet: Fleet | None = None):
        self.cfg = cfg
        self.engine = engine_for(cfg.backend)
        self._owns_fleet = fleet is None
        self.fleet = fleet or Fleet(cfg.addresses, api_key=cfg.api_key,
                                    max_connections=cfg.max_connections,
                                    keepalive_s=cfg.keepalive_s, dead_engine=self.engine.dead_engine)
        # Control calls (pause, weight updates: the syncer's, on the shared fleet) are
        # watched for stalls as generation is (Fleet.request).
        self.fleet.stall_after_s, self.fleet.stall_probe_s = cfg.stall_after_s, cfg.stall_probe_s
        self._cancelled: set[str] = set()
        self._wire: dict[str, tuple[Server, str]] = {}  # rid -> (server, wire rid) in flight
        self._background: set[asyncio.Task] = set()
        self._watchdog: asyncio.Task | None = None  # _watch_stalls
        # group key -> the server its first sample went to (most recent groups only)
        self._affinity: OrderedDict[str, str] = OrderedDict()
        self._rates: deque[float] = deque(maxlen=256)  # tokens/s of recent finished attempts

    async def __aenter__(self) -> RolloutClient:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def start(self) -> None:
        if self._owns_fleet:
            await self.fleet.start()
            await self.engine.detect_all(self.fleet)
        self._watchdog = asyncio.ensure_future(self._watch_stalls())

    async def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            await asyncio.gather(self._watchdog, return_exceptions=True)
            self._watchdog = None
        for task in list(self._background):  # background aborts of timed-out requests
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        if self._owns_fleet:
            await self.fleet.close()

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
        last = ""  # this call's last failure, for the error when no server is left
        for wire in itertools.count():
            if c.rid in self._cancelled:  # cancelled between two attempts
                self._cancelled.discard(c.rid)
                c.finish_reason = {"type": "abort", "message": "cancelled by the client"}
                return c
            remaining = sampling.max_new_tokens - len(c.output_ids)
            params = dataclasses.replace(
                sampling, max_new_tokens=remaining,
                min_new_tokens=max(0, sampling.min_new_tokens - len(c.output_ids)))
            try:
                server = await self._choose(failed, group)
            except RolloutError as e:
                also = f"; its last attempt failed on {last}" if last and last not in str(e) else ""
                raise RolloutError(f"rid {c.rid}: {e}{also}", e.failed) from None
            path, body = self.engine.generate_request(server, c.input_ids + c.output_ids,
                                                      params, f"{c.rid}.{wire}",
                                                      routed_experts=self.cfg.return_routed_experts)
            if not server.in_flight:  # a busy period starts: so does its stall clock
                server.last_answer = time.monotonic()
            server.in_flight += 1
            self._wire[c.rid] = (server, f"{c.rid}.{wire}")
            sent = time.monotonic()
            attempt = asyncio.ensure_future(self._attempt(
                server, path, body, timeout=self.deadline(remaining), wire_rid=f"{c.rid}.{wire}"))
            server.attempts.add(attempt)
            try:
                try:
                    out = await attempt
                except asyncio.CancelledError:  # by _watch_stalls, or this call's own cancel
                    if not server.stalled or asyncio.current_task().cancelling():
                        raise
                    raise _Retryable("the server stalled") from None
                server.last_answer = time.monotonic()
                try:
                    chunk = self.engine.read_generate(server, out, remaining, vocab_size=self.cfg.vocab_size)
                except BadAnswer as e:
                    self._bad_answer(server, e)
                    raise _Retryable(str(e)) from None
                server.answers += 1
            except _Retryable as e:
                c.attempts += 1
                failed.add(server.address)
                last = str(e) if server.address in str(e) else f"{server.address}: {e}"
                log.warning("rid %s failed on %s (%s); %d attempt(s) so far", c.rid,
                            server.address, e, c.attempts)
                if c.attempts >= self.cfg.max_attempts:
                    raise RolloutError(f"rid {c.rid}: {c.attempts} attempts failed, last on "
                                       f"{server.address}: {e}", sorted(failed)) from None
                await asyncio.sleep(self.cfg.retry_delay_s)
                continue
            finally:
                server.in_flight -= 1
                server.attempts.discard(attempt)
                self._wire.pop(c.rid, None)
            if chunk.output_ids and chunk.finish_reason["type"] != "abort":
                self._rates.append(len(chunk.output_ids) / max(time.monotonic() - sent, 1e-3))
            c.output_ids += chunk.output_ids
            c.logprobs += chunk.logprobs
            c.versions += chunk.versions
            if self.cfg.return_routed_experts and (chunk.routed_experts is not None or chunk.output_ids):
                # A resubmitted attempt prefills input + output so far again, so its routing
                # covers the whole completion (the servers' current weights' choice).
                c.routed_experts = chunk.routed_experts
            c.finish_reason = chunk.finish_reason
            if (c.finish_reason["type"] == "abort" and c.rid not in self._cancelled
                    and len(chunk.output_ids) < remaining):
                continue  # aborted by a pause or a weight update: resume where it stopped
            self._cancelled.discard(c.rid)
            return c
        raise AssertionError("unreachable")

    def deadline(self, tokens: int) -> float:
        """How long an attempt to generate up to ``tokens`` may take before it is retried
        elsewhere (a timeout: ``_attempt`` aborts it there): ``tokens`` at the floor rate,
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
            pinned = [s for s in self.fleet.servers if s.address == address and s.healthy
                      and s.address not in failed]
            if pinned:
                self._affinity.move_to_end(group)
                return pinned[0]
        for _ in range(2):
            ok = [s for s in self.fleet.servers if s.healthy]
            fresh = [s for s in ok if s.address not in failed]
            if fresh or ok:
                chosen = min(fresh or ok, key=lambda s: s.in_flight)
                if group is not None:
                    self._affinity[group] = chosen.address
                    while len(self._affinity) > 65536:
                        self._affinity.popitem(last=False)
                return chosen
            # Within the stall probe's budget: with no healthy server left, generate's
            # last try waits on this twice before it gives up.
            await self.fleet.check_health(timeout=min(10.0, self.cfg.stall_probe_s))
        faulty = [s.fault for s in self.fleet.servers if s.faulty]
        raise RolloutError(f"no healthy rollout server among {self.cfg.addresses}"
                           + (f"; faulty for bad answers: {'; '.join(faulty)}" if faulty else ""),
                           [s.address for s in self.fleet.servers])

    async def _watch_stalls(self) -> None:
        """Marks stalled servers (see RolloutConfig.stall_after_s) unhealthy and sends their
        requests elsewhere: each in-flight attempt there is cancelled, and ``generate``
        retries it on another server (from what it generated, as after an abort)."""
        while True:
            await asyncio.sleep(min(10.0, self.cfg.stall_after_s / 2))
            for s in self.fleet.servers:
                quiet = time.monotonic() - s.last_answer
                if not (s.healthy and s.in_flight and quiet > self.cfg.stall_after_s):
                    continue
                if await self.fleet.probe(s, self.cfg.stall_probe_s) == OK:
                    s.last_answer = time.monotonic()  # alive: long generations, no answer yet
                    continue
                if s.stalled:  # found meanwhile by a watched control call or the push's probe
                    continue
                log.warning("rollout server %s stalled: no answer for %.0f s and none to /health "
                            "within %.0f s; its %d request(s) go to the other servers", s.address,
                            quiet, self.cfg.stall_probe_s, s.in_flight)
                self.fleet.mark_stalled(s)

    async def _attempt(self, s: Server, path: str, body: dict, *, timeout: float, wire_rid: str):
        """One generate attempt; what another server may serve raises ``_Retryable``."""
        try:
            return await self.fleet.request(s, "POST", path, body, timeout=timeout, control=False)
        except TransientError as e:
            if isinstance(e, BadAnswer):  # a body that is not JSON
                self._bad_answer(s, e)
            if e.timed_out:
                # The server may still be generating it; free its slot there (the retry
                # goes out under a new wire rid, so it cannot collide with this one).
                task = asyncio.ensure_future(self._abort_on(s, wire_rid))
                self._background.add(task)
                task.add_done_callback(self._background.discard)
            raise _Retryable(str(e)) from None

    def _bad_answer(self, s: Server, e: BadAnswer) -> None:
        """Counts a bad answer of ``s`` (``generate`` retries the attempt elsewhere); the
        ``max_bad_answers``-th within ``BAD_ANSWER_WINDOW`` of its answers makes it faulty:
        unhealthy for good (``check_health`` keeps it so), and reported gone to the weight
        syncer, which drops it before its next push: a server that lies about its tokens
        is not trusted with the next weights either. Its attempts in flight finish: their
        answers are checked as any."""
        s.answers += 1
        s.bad_at = [n for n in s.bad_at if s.answers - n < BAD_ANSWER_WINDOW] + [s.answers]
        if s.faulty or len(s.bad_at) < self.cfg.max_bad_answers:
            return
        s.healthy, s.faulty = False, True
        s.fault = str(e) if s.address in str(e) else f"{s.address}: {e}"
        log.warning("rollout server %s is faulty: %d bad answers within its last %d, the last: %s; "
                    "it gets no more requests, and the next weight push drops it", s.address,
                    len(s.bad_at), min(s.answers, BAD_ANSWER_WINDOW), e)

    async def _abort_on(self, s: Server, rid: str) -> None:
        try:
            await self.engine.abort(self.fleet, s, rid)
        except RolloutError:
            pass

    # ---- generation control (the engine's protocol) --------------------------------------
    async def abort(self, rid: str) -> None:
        """Cancels one request; ``generate`` then returns it as aborted."""
        self._cancelled.add(rid)
        if rid in self._wire:
            server, wire = self._wire[rid]
            await self.engine.abort(self.fleet, server, wire)

    async def abort_all(self) -> None:
        await self.engine.abort_all(self.fleet)

    async def pause(self, mode: str = "abort") -> None:
        await self.engine.pause(self.fleet, mode)

    async def continue_(self) -> None:
        await self.engine.resume(self.fleet)

    async def weight_versions(self) -> list[str]:
        """Every server's weight version."""
        return await self.engine.weight_versions(self.fleet)
