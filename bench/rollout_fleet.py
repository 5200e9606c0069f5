"""A simulated fleet of K SGLang servers driven by the real RolloutClient and RolloutExecutor.

Each server is an aiohttp app speaking the SGLang subset the client uses (``/generate``
with ``meta_info`` as SGLang 0.5.23 answers, ``/server_info``, ``/abort_request``, pause
and continue), backed by a model of the engine instead of a GPU: continuous batching with
a decode step of ``step_s + step_per_seq_s x batch`` (simulated seconds, run ``speedup``
times faster), admission by KV availability up to ``max_running`` and retraction of the
newest running request when the pool runs out (SGLang's ``retract_decode``), the response
length drawn from the boba distribution by the request's ``sampling_seed``. All servers run
on one event loop over loopback, in a child process (``ProcessFleet``; ``SimFleet`` runs them
in a thread, for tests); the client and executor run in the main thread, whose CPU time
is the client's.

One boba-shaped async step: 512 groups x 16 samples, lengths and KV pool divided by
``token_scale`` (occupancy and wall/ideal are unchanged by it; JSON stays small enough for
two cores). It reports the mean running sequences per server against the configured
concurrency, the steady steps' wall time against the ideal (decode work / fleet capacity
at that concurrency) and the client's CPU time per request, for every boba config at
K = 16 and 128, and with ``--baseline`` the same at the old 1,024-connection cap (same
process, ratios printed). Run: ``python bench/rollout_fleet.py [--k 16 128] [--configs
32b_ppo ...] [--baseline]``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import multiprocessing
import resource
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from areal_mcore.data.prompts import Prompt
from areal_mcore.plan.lengths import boba_lengths
from areal_mcore.rollout.client import ClientConfig, RolloutClient, relax_gc
from areal_mcore.rollout.config import RolloutConfig
from areal_mcore.rollout.episodes import EpisodeEnv
from areal_mcore.rollout.episodes.single_turn import SingleTurn
from areal_mcore.rollout.executor import RolloutExecutor
from areal_mcore.rollout.protocol import SamplingParams

RESULTS = Path(__file__).parent / "results" / "rollout_fleet.json"
EOS = 151643  # Qwen's <|endoftext|>: the id the simulated engine stops on
# Realistic token ids and logprobs (their JSON size is what the client parses).
_IDS = [(i * 7919) % 150000 + 100 for i in range(40000)]
_LOGPROBS = [[-((i * 37) % 1000) / 997.0, t, None] for i, t in enumerate(_IDS)]


@dataclass(kw_only=True)
class EngineModel:
    """One simulated server: its KV pool, batch limit, decode-time model and lengths."""

    kv_tokens: int
    max_running: int
    lengths: tuple[int, ...]  # where a response hits EOS, drawn by sampling_seed
    step_s: float = 0.025  # a decode step at batch 1 (simulated seconds: memory-bound weights read)
    step_per_seq_s: float = 0.0004  # added per running sequence (its KV read)
    speedup: float = 1.0  # simulated seconds per wall second

    def step_time(self, batch: int) -> float:
        return self.step_s + self.step_per_seq_s * batch

    def capacity(self, batch: int) -> float:
        """Tokens per simulated second at ``batch`` running sequences."""
        return batch / self.step_time(batch)


@dataclass(eq=False)
class _Seq:
    rid: str
    prompt: int
    goal: int  # tokens this request generates
    stop: bool  # ends on EOS (else at max_new_tokens)
    fut: asyncio.Future
    v0: float = 0.0  # the server's token clock when this sequence's first token would have come
    generated: float = 0.0  # kept across a retraction


class SimServer:
    """The engine model behind SGLang's HTTP API. Between events (arrival, completion, KV
    overrun) the batch is constant and every running sequence gains one token per step:
    a token clock ``v`` advances by elapsed / step_time(batch), and a sequence has generated
    ``v - v0``. Only events cost CPU, not tokens."""

    def __init__(self, model: EngineModel):
        self.m = model
        self.running: list[_Seq] = []
        self.waiting: deque[_Seq] = deque()
        self.v, self.last = 0.0, time.monotonic()
        self.paused = False
        self.retracted = 0
        self.area = 0.0  # running sequences x wall seconds, for the mean occupancy
        self.tokens = 0.0  # decoded so far (the work done, whatever the batch it lands in)
        self._timer: asyncio.TimerHandle | None = None

    # ---- the engine ----------------------------------------------------------------------
    def _advance(self) -> None:
        now = time.monotonic()
        if self.running:
            steps = (now - self.last) * self.m.speedup / self.m.step_time(len(self.running))
            self.v += steps
            self.area += (now - self.last) * len(self.running)
            self.tokens += steps * len(self.running)
        self.last = now

    def _used(self) -> float:
        return sum(s.prompt + self.v - s.v0 for s in self.running)

    def _event(self) -> None:
        """Finish what reached its goal, retract on KV overrun, admit, and set the next event."""
        self._advance()
        for s in [s for s in self.running if s.v0 + s.goal <= self.v + 1e-6]:
            self.running.remove(s)
            s.fut.done() or s.fut.set_result((s.goal, {"type": "stop", "matched": EOS} if s.stop
                                              else {"type": "length", "length": s.goal}))
        while len(self.running) > 1 and self._used() > self.m.kv_tokens:
            s = self.running.pop()  # SGLang retracts the newest; it re-prefills later
            s.generated = self.v - s.v0
            self.waiting.appendleft(s)
            self.retracted += 1
        used = self._used()
        while self.waiting and not self.paused and len(self.running) < self.m.max_running:
            s = self.waiting[0]
            if self.running and used + s.prompt + s.generated + 1 > self.m.kv_tokens:
                break
            self.waiting.popleft()
            s.v0 = self.v - s.generated
            used += s.prompt + s.generated
            self.running.append(s)
        self._schedule(used)

    def _schedule(self, used: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self.running:
            return
        n = len(self.running)
        target = min(s.v0 + s.goal for s in self.running)
        target = min(target, self.v + max(0.0, self.m.kv_tokens - used) / n)  # the pool runs out
        delay = max(0.0, target - self.v) * self.m.step_time(n) / self.m.speedup
        self._timer = asyncio.get_running_loop().call_later(delay, self._event)

    def _abort(self, seqs: list[_Seq]) -> None:
        self._advance()
        for s in seqs:
            done = int(self.v - s.v0) if s in self.running else int(s.generated)
            (self.running if s in self.running else self.waiting).remove(s)
            s.fut.done() or s.fut.set_result((min(done, s.goal), {"type": "abort", "message": "Abort."}))
        self._event()

    # ---- HTTP ----------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/server_info", self.server_info)
        app.router.add_get("/model_info", self.model_info)
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/abort_request", self.abort_request)
        app.router.add_post("/pause_generation", self.pause)
        app.router.add_post("/continue_generation", self.resume)
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": "0", "is_generation": True})

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response({"version": "0.5.23", "tp_size": 1, "dp_size": 1, "pp_size": 1,
                                  "max_running_requests": self.m.max_running,
                                  "internal_states": [{"num_running_reqs": len(self.running)}]})

    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        try:
            params = SamplingParams.from_json(body.get("sampling_params") or {})
        except ValueError as e:
            return web.json_response({"error": {"message": str(e)}}, status=400)
        rid, prompt = str(body["rid"]), len(body["input_ids"])
        eos = self.m.lengths[(params.sampling_seed or hash(rid)) * 2654435761 % len(self.m.lengths)]
        goal = min(eos, params.max_new_tokens)
        s = _Seq(rid, prompt, goal, eos <= params.max_new_tokens, asyncio.get_running_loop().create_future())
        self.waiting.append(s)
        self._event()
        try:
            n, reason = await s.fut
        except asyncio.CancelledError:  # the client went away: free its slot
            if s in self.running or s in self.waiting:
                self._abort([s])
            raise
        meta = {"id": rid, "finish_reason": reason, "prompt_tokens": prompt, "completion_tokens": n,
                "cached_tokens": 0, "weight_version": "0",
                "weight_versions": [{"start": 0, "end": n, "version": "0"}]}
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = _LOGPROBS[:n]
        return web.json_response({"output_ids": _IDS[:n], "meta_info": meta})

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await request.json()
        seqs = [*self.running, *self.waiting]
        self._abort(seqs if body.get("abort_all") else [s for s in seqs if s.rid == body.get("rid")])
        return web.Response()

    async def pause(self, request: web.Request) -> web.Response:
        self.paused = True
        self._abort([*self.running, *self.waiting])
        return web.json_response({"status": "ok"})

    async def resume(self, request: web.Request) -> web.Response:
        self.paused = False
        self._event()
        return web.json_response({"status": "ok"})


class SimFleet:
    """K SimServers on one event loop in a background thread."""

    def __init__(self, k: int, model: EngineModel):
        self.servers = [SimServer(model) for _ in range(k)]
        self.addresses: list[str] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runners: list[web.AppRunner] = []

    def __enter__(self) -> SimFleet:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result()
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()

    async def _start(self) -> None:
        for s in self.servers:
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            runner = web.AppRunner(s.app(), access_log=None)
            await runner.setup()
            # A listen backlog for a whole fleet's requests arriving at once (aiohttp's 128
            # drops SYNs, and the kernel retries them only after a second).
            await web.SockSite(runner, sock, backlog=4096).start()
            self._runners.append(runner)
            self.addresses.append(f"127.0.0.1:{sock.getsockname()[1]}")

    async def _stop(self) -> None:
        for s in self.servers:  # answer what is left (the client may have gone already)
            s._abort([*s.running, *s.waiting])
        for r in self._runners:
            await r.cleanup()
        rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in rest:  # the sampler, handlers of connections the client dropped
            t.cancel()
        await asyncio.gather(*rest, return_exceptions=True)

    def area(self) -> tuple[float, float, float]:
        """(now, running sequences x seconds, tokens decoded), summed over the servers so
        far: the mean occupancy between two calls is the area's difference over the time
        between, over K."""
        async def read():
            for s in self.servers:
                s._advance()
            return time.monotonic(), sum(s.area for s in self.servers), sum(s.tokens for s in self.servers)
        return asyncio.run_coroutine_threadsafe(read(), self._loop).result()

    def retracted(self) -> int:
        return sum(s.retracted for s in self.servers)


class ProcessFleet:
    """A SimFleet in a child process: the client's process then holds one socket per
    request, not two (a boba fleet's 12k requests in flight pass a 20k open-file limit
    otherwise), and the servers' CPU does not compete for the client's GIL."""

    def __init__(self, k: int, model: EngineModel):
        ctx = multiprocessing.get_context("fork")  # no threads yet in the bench's process
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(k, model, child), daemon=True)

    def __enter__(self) -> ProcessFleet:
        self._proc.start()
        self.addresses = self._conn.recv()
        return self

    def __exit__(self, *exc) -> None:
        self._conn.send(None)
        self._proc.join(30)

    def area(self) -> tuple[float, float, float]:
        self._conn.send(("area",))
        return self._conn.recv()

    def retracted(self) -> int:
        self._conn.send(("retracted",))
        return self._conn.recv()


def _serve(k: int, model: EngineModel, conn) -> None:
    _allow_open_files(10**6)  # capped at the hard limit
    with SimFleet(k, model) as fleet:
        conn.send(fleet.addresses)
        while (ask := conn.recv()) is not None:
            conn.send(getattr(fleet, ask[0])(*ask[1:]))


def _allow_open_files(n: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < n:
        resource.setrlimit(resource.RLIMIT_NOFILE, (n if hard == resource.RLIM_INFINITY else min(n, hard), hard))


# ---- one boba step --------------------------------------------------------------------------
@dataclass(kw_only=True)
class Case:
    name: str
    k: int  # servers
    per_server: float  # configured sequences in flight per server
    max_running: int
    kv_tokens: int  # per server, full scale
    max_new_tokens: int = 27648
    prompt_tokens: int = 512
    n_samples: int = 16
    batch_size: int = 512  # groups per step (boba: 512 x 16 = 8,192 samples)
    max_head_offpolicyness: int = 4
    token_scale: int = 16
    steps: int = 3  # the first fills the fleet; the others are the steady state measured
    # The ideal step's wall time the simulation runs at (a real boba step takes minutes): at
    # 15 s the client's CPU (~3 ms a request here, 2 cores shared with the servers) was the
    # limit for 8,192 requests a step; at 40 s it is not.
    step_wall_s: float = 40.0
    client_cap: int | None = None  # the client's connections (the baseline: the old 1,024); None: the config's

    @property
    def groups(self) -> int:
        return max(1, round(self.per_server * self.k / self.n_samples))


def _model(case: Case) -> EngineModel:
    lengths = tuple(max(1, t // case.token_scale) for t in boba_lengths(case.max_new_tokens).tokens)
    m = EngineModel(kv_tokens=case.kv_tokens // case.token_scale, max_running=case.max_running, lengths=lengths)
    mean = sum(lengths) / len(lengths)
    busy = min(case.per_server, case.max_running)
    ideal = case.batch_size * case.n_samples * mean / (case.k * m.capacity(busy))
    m.speedup = ideal / case.step_wall_s
    return m


async def _drive(case: Case, fleet: SimFleet, model: EngineModel) -> dict:
    rollout = RolloutConfig(max_new_tokens=case.max_new_tokens // case.token_scale, n_samples=case.n_samples,
                            max_concurrent_rollouts=case.groups, max_head_offpolicyness=case.max_head_offpolicyness)
    prompt = [_IDS[i] for i in range(case.prompt_tokens // case.token_scale)]
    prompts = (Prompt(input_ids=prompt, solutions=("1",), source=f"p{i}") for i in itertools.count())

    async def reward(items):
        return [float(i % 2) for i in range(len(items))]

    relax_gc()  # as the trainer's rank 0 does
    connections = case.client_cap or rollout.connections
    client = RolloutClient(ClientConfig(addresses=fleet.addresses, max_connections=connections, backend="sglang"))
    async with client:
        episode = SingleTurn(rollout, EpisodeEnv(score=reward, decode=lambda ids: ""))
        ctrl = RolloutExecutor(rollout, client, episode, batch_size=case.batch_size, sync=False)
        ctrl.submit(prompts)
        areas, tokens = [fleet.area()], []
        cpu0 = time.thread_time()
        for step in range(case.steps):
            batch = await ctrl.wait(case.batch_size)
            ctrl.set_version(step + 1)
            areas.append(fleet.area())
            tokens.append(sum(len(s.output_ids) for s in batch.samples))
        cpu = time.thread_time() - cpu0
        await ctrl.stop()
    steady = slice(1, case.steps)
    wall = areas[-1][0] - areas[1][0]
    work = sum(tokens[steady])
    busy = min(case.per_server, case.max_running)
    ideal = work / (case.k * model.capacity(busy)) / model.speedup
    occ = [(a1 - a0) / (t1 - t0) / case.k for (t0, a0, _), (t1, a1, _) in itertools.pairwise(areas)]  # per step
    # The same wall against the work decoded in it: a step's batch also holds work done in
    # the step before (up to max_head_offpolicyness batches are in flight), which the
    # batch's own tokens (wall_over_ideal) credit to it.
    decoded = (areas[-1][2] - areas[1][2]) / (case.k * model.capacity(busy)) / model.speedup
    requests = case.steps * case.batch_size * case.n_samples
    return {"case": case.name, "k": case.k, "groups": case.groups, "connections": connections,
            "configured_per_server": case.per_server, "max_running": case.max_running,
            "occupancy_mean": (areas[-1][1] - areas[1][1]) / wall / case.k,
            "occupancy_per_step": [round(x, 1) for x in occ],
            "wall_over_ideal": wall / ideal, "wall_over_decoded_ideal": wall / decoded,
            "step_wall_s": wall / (case.steps - 1),
            "client_cpu_ms_per_request": 1e3 * cpu / requests,
            "client_cpu_us_per_token": 1e6 * cpu / sum(tokens),
            "retracted": fleet.retracted()}


def run_case(case: Case) -> dict:
    need = case.groups * case.n_samples + 1024  # the client's sockets, one per request
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and need > hard:
        return {"case": case.name, "k": case.k, "skipped": f"needs {need} open files, the hard limit is {hard}"}
    model = _model(case)
    with ProcessFleet(case.k, model) as fleet:  # the client raises its own open-file limit
        return asyncio.run(_drive(case, fleet, model))


def boba_case(config: str, k: int, **kw) -> Case:
    """A Case with the per-server concurrency, batch limit and KV pool of configs/boba_<config>.yaml."""
    from areal_mcore.config import load_config
    from areal_mcore.plan.planner import make_plan

    cfg = load_config(f"configs/boba_{config}.yaml")
    server = make_plan(cfg, with_fixes=False).server
    r = cfg.rollout
    return Case(name=config, k=k, per_server=r.max_concurrent_rollouts * r.n_samples / server["n_servers"],
                max_running=cfg.server.max_running_requests, kv_tokens=server["kv_tokens"],
                max_new_tokens=r.max_new_tokens, n_samples=r.n_samples, batch_size=cfg.trainer.batch_size,
                max_head_offpolicyness=r.max_head_offpolicyness, **kw)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="+", default=["1.5b", "7b", "32b_ppo"])
    p.add_argument("--k", nargs="+", type=int, default=[16, 128])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--step-wall-s", type=float, default=40.0)
    p.add_argument("--baseline", action="store_true", help="also run each case at the old 1,024-connection cap")
    # Capped, the servers run a fraction full and a step takes many times the ideal: run it
    # with a shorter ideal (its requests per second stay as low as the uncapped run's).
    p.add_argument("--baseline-step-wall-s", type=float, default=4.0)
    a = p.parse_args()
    rows = []
    for config, k in itertools.product(a.configs, a.k):
        new = run_case(boba_case(config, k, steps=a.steps, step_wall_s=a.step_wall_s))
        rows.append(new)
        print(json.dumps(new), flush=True)
        if a.baseline and "skipped" not in new and new["connections"] > 1024:
            old = run_case(boba_case(config, k, steps=a.steps, step_wall_s=a.baseline_step_wall_s, client_cap=1024))
            old["baseline"] = "1024 connections"
            rows.append(old)
            print(json.dumps(old), flush=True)
            print(f"  {config} K={k}: occupancy x{new['occupancy_mean'] / old['occupancy_mean']:.2f}, "
                  f"step wall / ideal x{new['wall_over_ideal'] / old['wall_over_ideal']:.2f} against the 1,024 cap",
                  flush=True)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
