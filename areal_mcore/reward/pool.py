"""A pool of killable, resource-limited reward workers (``python -m areal_mcore.reward.worker``).

Each worker is a separate interpreter with an address-space limit and a CPU-time limit
(model text reaches sympy). The parent enforces a wall-clock deadline per item: a
worker that overruns is killed and replaced, the item scores 0.0 and is counted in
``timeouts``; a reward function that raises (or returns no number) scores 0.0 and is
counted in ``errors``. Workers are also replaced after ``max_items_per_worker`` items, so
the cumulative CPU-time limit and memory growth never bite a healthy worker. What they run
is ``reward.fn`` (``reward/fn.py``; boba's math-verify check by default).
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import selectors
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field

from areal_mcore.checks import FieldError, check_positive
from areal_mcore.procs import child_env, die_with_parent
from areal_mcore.reward.fn import DEFAULT_FN, import_root, load_reward_fn
from areal_mcore.reward.tool_call import ToolCall


@dataclass(kw_only=True)
class RewardPoolConfig:
    # package.module:function, called per sample as fn(prompt, completion, prompt_ids,
    # completion_ids, solutions, **fields) -> float (reward/fn.py); imported and checked here.
    fn: str = DEFAULT_FN
    num_workers: int = 2
    timeout_s: float = 5.0
    memory_mb: int = 2048
    cpu_s: int = 600
    max_items_per_worker: int = 2000
    # Tool calls of multi-turn episodes (reward/tool_call.py) run in the same workers: each has
    # this wall-clock limit, and its observation is cut to this many characters.
    tool_timeout_s: float = 5.0
    tool_max_output_chars: int = 2000

    def __post_init__(self):
        for key in ("num_workers", "timeout_s", "memory_mb", "cpu_s", "max_items_per_worker", "tool_timeout_s",
                    "tool_max_output_chars"):
            check_positive(key, getattr(self, key))
        try:
            load_reward_fn(self.fn)
        except ValueError as e:
            raise FieldError("fn", f"={self.fn!r} {e}") from None


@dataclass(frozen=True)
class RewardItem:
    """One sample to score: what ``reward.fn`` is called with."""

    completion: str
    solutions: list[str]
    prompt: str = ""
    prompt_ids: list[int] = field(default_factory=list)
    completion_ids: list[int] = field(default_factory=list)
    fields: dict = field(default_factory=dict)  # the prompt's other fields (e.g. source)


@dataclass
class RewardCounts:
    """Items scored 0.0 because the function raised (``errors``) or overran (``timeouts``),
    for one consumer of the pool (the training rollouts, the evals)."""

    errors: int = 0
    timeouts: int = 0


class _Worker:
    def __init__(self, cfg: RewardPoolConfig):
        limits = (cfg.memory_mb << 20, cfg.cpu_s)

        def restrict():  # runs in the child before exec
            die_with_parent()  # not only stdin's EOF: a long math-verify call ends too
            resource.setrlimit(resource.RLIMIT_AS, (limits[0], limits[0]))
            resource.setrlimit(resource.RLIMIT_CPU, (limits[1], limits[1] + 5))

        # math-verify's own timeouts stay under the parent's deadline.
        inner = max(1, int(cfg.timeout_s / 3))
        # `python -m` puts the cwd first on sys.path, not the trainer's path: hand the
        # workers the folder reward.fn's module was imported from.
        env, root = child_env(), import_root(cfg.fn)
        if root is not None:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "areal_mcore.reward.worker", cfg.fn, str(inner), str(cfg.tool_max_output_chars)],
            env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            preexec_fn=restrict, text=True, encoding="utf-8", errors="surrogatepass", bufsize=1,
        )
        self.items = 0
        self.busy: tuple[int, float] | None = None  # (item index, deadline)
        self.ready = False

    def send(self, index: int, item: RewardItem | ToolCall, deadline: float) -> None:
        if isinstance(item, ToolCall):
            line = {"id": index, "tool": item.tool, "args": item.args}
        else:
            line = {"id": index, "prompt": item.prompt, "completion": item.completion, "prompt_ids": item.prompt_ids,
                    "completion_ids": item.completion_ids, "solutions": list(item.solutions), "fields": item.fields}
        self.proc.stdin.write(json.dumps(line) + "\n")
        self.proc.stdin.flush()
        self.busy = (index, deadline)
        self.items += 1

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass


class RewardPool:
    """``score_items(items) -> rewards`` and ``run_tools(calls) -> observations`` over
    killable worker processes; ``timeouts`` and ``errors`` count every item scored 0.0 for
    overrunning or raising (tool calls answer with an error observation instead)."""

    def __init__(self, cfg: RewardPoolConfig | None = None):
        self.cfg = cfg or RewardPoolConfig()
        self.timeouts = 0
        self.errors = 0
        self.crashes = 0
        self.latencies: list[float] = []
        self._failed_starts = 0
        self._pending = 0
        self._lock = threading.Lock()
        self._turns: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> its lock
        self._workers = [_Worker(self.cfg) for _ in range(self.cfg.num_workers)]

    def score(self, completions: list[str], solutions_list: list[list[str]]) -> list[float]:
        """``score_items`` of completions without prompt or ids (the filters, the tests)."""
        if len(completions) != len(solutions_list):
            raise ValueError(f"{len(completions)} completions but {len(solutions_list)} solution lists")
        return self.score_items([RewardItem(completion=c, solutions=list(s))
                                 for c, s in zip(completions, solutions_list)])

    def score_items(self, items: list[RewardItem], counts: RewardCounts | None = None) -> list[float]:
        """Rewards in input order; every item returns within ``timeout_s`` (+ scheduling).
        ``counts`` also gets this call's errors and timeouts."""
        errors, timeouts = self.errors, self.timeouts
        try:
            with self._lock:
                return [float(r) for r in self._run(items, self.cfg.timeout_s)]
        finally:
            if counts is not None:
                counts.errors += self.errors - errors
                counts.timeouts += self.timeouts - timeouts

    def run_tools(self, calls: list[ToolCall]) -> list[str]:
        """Each call's observation in input order (``reward/tool_call.py``); every call returns
        within ``tool_timeout_s`` (+ scheduling), as an ``error: ...`` observation when its
        tool raised, overran or killed its worker."""
        with self._lock:
            return self._run(calls, self.cfg.tool_timeout_s)

    async def ascore(self, items: list[RewardItem], counts: RewardCounts | None = None) -> list[float]:
        """``score_items`` off the event loop. Calls wait their turn here: the pool serves
        one at a time, and the training rollouts and an eval in async mode share it."""
        async with self._turn():
            return await asyncio.to_thread(self.score_items, items, counts)

    async def arun_tools(self, calls: list[ToolCall]) -> list[str]:
        """``run_tools`` off the event loop, in turn with ``ascore``."""
        async with self._turn():
            return await asyncio.to_thread(self.run_tools, calls)

    def _turn(self) -> asyncio.Lock:
        """This event loop's lock on the pool (an asyncio lock serves one loop; the
        threading lock in ``score_items`` and ``run_tools`` guards across loops)."""
        loop = asyncio.get_running_loop()
        if loop not in self._turns:
            self._turns[loop] = asyncio.Lock()
        return self._turns[loop]

    def _run(self, items: list, timeout_s: float) -> list:
        """Each item's answer (a reward, or a tool's observation) in input order."""
        out: list = [None] * len(items)
        todo = list(range(len(items)))[::-1]
        started: dict[int, float] = {}
        self._pending = len(items)
        while self._pending:  # a counter: rescanning all answers every poll is quadratic
            for slot, w in enumerate(self._workers):
                if w.busy is None and w.ready and todo:
                    i = todo.pop()
                    started[i] = time.monotonic()
                    try:
                        w.send(i, items[i], started[i] + timeout_s)
                    except (BrokenPipeError, OSError):  # died while idle: replace, retry the item
                        todo.append(i)
                        self._replace(slot, crashed=True)
            self._poll(items, out, started, timeout_s)
        return out

    def _poll(self, items, out, started, timeout_s: float) -> None:
        sel = selectors.DefaultSelector()
        for slot, w in enumerate(self._workers):
            sel.register(w.proc.stdout, selectors.EVENT_READ, slot)
        deadlines = [w.busy[1] for w in self._workers if w.busy]
        wait = max(0.0, min(deadlines) - time.monotonic()) if deadlines else 0.5
        events = sel.select(timeout=min(wait, 0.5))
        sel.close()
        for key, _ in events:
            slot = key.data
            w = self._workers[slot]
            line = w.proc.stdout.readline()
            if not line:  # EOF: the worker died (memory or CPU limit, or a crash)
                if not w.ready:
                    self._failed_starts += 1
                    if self._failed_starts >= 3:
                        raise RuntimeError(
                            "reward workers exit before they are ready (3 times in a row); "
                            f"is memory_mb={self.cfg.memory_mb} too low to import math-verify?")
                if w.busy:  # its item killed it (e.g. the memory limit): an error
                    i = w.busy[0]
                    self._finish(out, started, i, self._failed(items[i], f"its worker died (reward.memory_mb="
                                                                          f"{self.cfg.memory_mb}, or a crash)"))
                self._replace(slot, crashed=True)
            elif line.strip() == "ready":
                w.ready = True
                self._failed_starts = 0
            else:
                answer = json.loads(line)
                self.errors += "error" in answer
                self._finish(out, started, answer["id"], answer["output"] if "output" in answer else answer["reward"])
                w.busy = None
                if w.items >= self.cfg.max_items_per_worker:
                    self._replace(slot)
        now = time.monotonic()
        for slot, w in enumerate(self._workers):
            if w.busy and now >= w.busy[1]:
                i = w.busy[0]
                if isinstance(items[i], ToolCall):
                    self._finish(out, started, i, f"error: the tool ran past {timeout_s:g} s and was stopped")
                else:
                    self.timeouts += 1
                    self._finish(out, started, i, 0.0)
                self._replace(slot)

    def _failed(self, item, why: str):
        """A dead worker's answer: a tool's observation, or a reward of 0 (an error)."""
        if isinstance(item, ToolCall):
            return f"error: the tool failed: {why}"
        self.errors += 1
        return 0.0

    def _finish(self, out, started, index, value) -> None:
        out[index] = value
        self._pending -= 1
        self.latencies.append(time.monotonic() - started[index])

    def _replace(self, slot: int, crashed: bool = False) -> None:
        self.crashes += crashed
        self._workers[slot].kill()
        self._workers[slot] = _Worker(self.cfg)

    def worker_pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers]

    def close(self) -> None:
        for w in self._workers:
            w.kill()
        self._workers = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
