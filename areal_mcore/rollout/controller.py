"""Rollout controller: prompts -> groups of sampled completions with rewards.

Synchronous mode (``rollout_batch``) samples a batch with the current weights. Async mode
(``start`` / ``prepare_batch``) keeps groups in flight while the trainer trains, with
AReaL's capacity rule bounding how stale a sample can be::

    capacity = min((max_concurrent * n_samples - generating) // n_samples,
                   (max_head_offpolicyness + version + 1) * batch_size - (accepted + running))

The first term counts samples still generating, not groups: a group's samples end at very
different lengths (boba's longest of 16 is ~2.5x the mean), and a group that holds its slot
until its last sample ends keeps the servers only ~40 % full (mean / longest; an early run
of ``bench/rollout_fleet.py``, confounded by the client's CPU, showed 28 %). So
``max_concurrent_rollouts`` groups' worth of requests stay in flight, and groups (``running``)
may outnumber it; the staleness term counts groups and is unchanged.

``accepted`` counts groups consumed or ready; it is restored from a checkpoint as the
number consumed, so the bound holds across resume. A group is also checked when it is
handed out: if its admission version is more than ``max_head_offpolicyness`` behind (a
slow group overtaken by newer ones), it is dropped and counted, never trained on.

DAPO's dynamic sampling (``dynamic_sampling``, arXiv 2503.14476) drops a group whose raw
rewards are all equal (boba's 0/1 correctness: all wrong or all right): after group
normalisation its advantages are all 0, so it only dilutes the batch. Such a group never
counts in ``accepted`` (like a stale one, it frees capacity for a fresh group), so the
staleness bound above holds for the groups that are trained on. One step looks at no
more than ``dynamic_sampling_max_rounds`` x batch_size groups: whole batches of prompts
in sync mode (rounds), landed groups in async mode; past that, the step trains on the
useful groups it has (possibly none), with a warning.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import uuid
import warnings
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from areal_mcore.checks import check_positive, field_error
from areal_mcore.data.prompts import Prompt
from areal_mcore.reward.pool import RewardItem
from areal_mcore.rollout.client import Completion, RolloutClient
from areal_mcore.rollout.protocol import SamplingParams

if TYPE_CHECKING:
    import numpy as np

RewardFn = Callable[[list[RewardItem]], Awaitable[list[float]]]  # e.g. RewardPool.ascore


@dataclass(kw_only=True)
class RolloutConfig:
    max_new_tokens: int
    n_samples: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    # SGLang refuses min_new_tokens > 0 under --skip-tokenizer-init (server.skip_tokenizer_init).
    min_new_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    max_concurrent_rollouts: int = 64  # prompt groups' worth of requests in flight (x n_samples)
    # The client's generation connections (one per request in flight). None: exactly the
    # requests in flight, max_concurrent_rollouts x n_samples; a smaller cap would leave
    # requests waiting inside the client while the servers have room for them.
    max_connections: int | None = None
    max_head_offpolicyness: int = 4
    seed: int = 1
    # A server with requests in flight that answered none for stall_after_s and does not
    # answer /health within stall_probe_s is stalled (a hung engine, a stopped process, a
    # node gone with its connections open): its requests go to the others, and the weight
    # sync drops it. A healthy SGLang answers /health within its own 20 s check.
    stall_after_s: float = 300.0
    stall_probe_s: float = 30.0
    # A slow server (it answers, at a crawl: a degraded GPU, a throttled node): a request
    # whose attempt takes longer than its remaining tokens at 1/slow_request_factor of
    # the fleet's median measured rate (and min_request_deadline_s) is retried on another
    # server. 0: off (request_timeout_s only). With weight_sync.pause_mode retract or
    # in_place requests wait out a sync: min_request_deadline_s must exceed a sync.
    slow_request_factor: float = 10.0
    min_request_deadline_s: float = 60.0
    # A server whose answer breaks its engine's contract (not JSON, token ids outside the
    # served vocabulary, logprobs that are NaN or do not match the tokens) gets that
    # request retried elsewhere; after max_bad_answers bad answers within 100 of its
    # answers it is faulty: no more requests, and the next weight push drops it.
    max_bad_answers: int = 3
    # DAPO dynamic sampling: drop groups whose raw rewards are all equal (all wrong or all
    # right) and sample on until the batch holds trainer.batch_size mixed groups, looking
    # at most dynamic_sampling_max_rounds x batch_size groups for one step.
    dynamic_sampling: bool = False
    dynamic_sampling_max_rounds: int = 4

    def __post_init__(self):
        check_positive("dynamic_sampling_max_rounds", self.dynamic_sampling_max_rounds)
        check_positive("slow_request_factor", self.slow_request_factor, allow_zero=True)
        check_positive("min_request_deadline_s", self.min_request_deadline_s)
        check_positive("max_bad_answers", self.max_bad_answers)
        check_positive("n_samples", self.n_samples)
        check_positive("stall_after_s", self.stall_after_s)
        check_positive("stall_probe_s", self.stall_probe_s)
        check_positive("max_concurrent_rollouts", self.max_concurrent_rollouts)
        if self.max_connections is not None and self.max_connections < self.in_flight:
            raise field_error("max_connections", self.max_connections,
                              f"is below the requests in flight, max_concurrent_rollouts x n_samples = "
                              f"{self.max_concurrent_rollouts} x {self.n_samples} = {self.in_flight}: "
                              f"raise it to at least {self.in_flight}, or null (follows them)")
        check_positive("max_head_offpolicyness", self.max_head_offpolicyness, allow_zero=True)
        check_positive("min_new_tokens", self.min_new_tokens, allow_zero=True)

    @property
    def in_flight(self) -> int:
        """The most generate requests in flight at once (one per sample of each group)."""
        return self.max_concurrent_rollouts * self.n_samples

    @property
    def connections(self) -> int:
        """The client's generation connection limit (``max_connections``, resolved)."""
        return self.in_flight if self.max_connections is None else self.max_connections

    def sampling(self) -> SamplingParams:
        return SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                              top_p=self.top_p, top_k=self.top_k, min_new_tokens=self.min_new_tokens,
                              stop_token_ids=list(self.stop_token_ids))


@dataclass
class Sample:
    group: int
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]  # weight version that produced each output token
    reward: float
    finish_reason: str  # stop | length | abort
    start_version: int  # trainer version when the group was admitted
    failovers: int = 0
    # MoE routing the engine returned (rollout.client.Completion.routed_experts), or None
    routed_experts: np.ndarray | None = None


@dataclass
class RolloutBatch:
    samples: list[Sample]
    version: int  # trainer version the batch is handed to
    stats: dict[str, float]


def is_mixed(group: list[Sample]) -> bool:
    """Whether a group's raw rewards (the reward function's, before bias, scaling,
    penalties and normalisation) differ: DAPO keeps only these (boba's 0/1 reward: some
    samples right and some wrong)."""
    return len({s.reward for s in group}) > 1


class PromptsExhausted(RuntimeError):
    """The prompt iterator ended before a full batch was ready."""


def _version(text: str) -> int:
    """Weight versions are step numbers; SGLang's initial 'default' is version 0."""
    return int(text) if text.lstrip("-").isdigit() else 0


def _versions(texts: list[str]) -> list[int]:
    """``_version`` of each token's version: parsed once per distinct value (a response has
    one or two): parsing each token's came first in a profile of ``bench/rollout_fleet.py``
    after JSON decoding, and a boba response has ~9k tokens."""
    table = {t: _version(t) for t in set(texts)}
    return [table[t] for t in texts]


class RolloutController:
    def __init__(self, cfg: RolloutConfig, client: RolloutClient, reward_fn: RewardFn,
                 decode: Callable[[list[int]], str]):
        self.cfg = cfg
        # Called with each finished group on the loop's thread, while others still generate
        # (the trainer packs samples into arrays there, off its dispatch path).
        self.on_group: Callable[[list[Sample]], None] | None = None
        self.client = client
        self.reward_fn = reward_fn
        self.decode = decode
        self.version = 0
        self.running = 0  # groups in flight
        self.generating = 0  # their samples still generating (requests in flight)
        self._slots: dict[int, int] = {}  # group -> request slots it holds (taken at admission)
        self.accepted = 0  # groups ready or consumed
        self.consumed = 0
        self.dropped_stale = 0
        self.dropped_uniform = 0  # groups dynamic sampling dropped (all rewards equal)
        self.max_generating_seen = 0
        # Async dynamic sampling: groups judged (kept or dropped) since the last batch.
        self._seen, self._kept = 0, 0
        self._next_group = 0
        self._nonce = uuid.uuid4().hex[:8]  # rids stay unique across restarts
        self._reward_lock = asyncio.Lock()  # the reward pool serves one call at a time
        self._ready: deque[list[Sample]] = deque()
        self._changed = asyncio.Event()
        self._paused = False
        self._task: asyncio.Task | None = None
        self._groups: set[asyncio.Task] = set()
        self._error: BaseException | None = None

    # ---- one group -----------------------------------------------------------------------
    def _take_slots(self, gid: int) -> None:
        self._slots[gid] = self.cfg.n_samples
        self.generating += self.cfg.n_samples
        self.max_generating_seen = max(self.max_generating_seen, self.generating)

    def _free_slots(self, gid: int, n: int | None = None) -> None:
        """Gives back ``n`` of the group's request slots (None: all it still holds); a
        group cancelled before some samples started gives theirs back at its end."""
        held = self._slots.get(gid, 0)
        n = held if n is None else min(n, held)
        if held - n:
            self._slots[gid] = held - n
        else:
            self._slots.pop(gid, None)
        self.generating -= n
        self._changed.set()

    async def _group(self, gid: int, prompt: Prompt, start_version: int) -> list[Sample]:
        base = self.cfg.sampling()
        # Seeds depend on (seed, group, sample) only: a failed-over sample is redrawn the
        # same way, and a rerun draws the same batch.
        try:
            comps: list[Completion] = await asyncio.gather(*[
                self._generate(gid, prompt.input_ids, dataclasses.replace(
                    base, sampling_seed=(self.cfg.seed * 1_000_003 + gid) * 1009 + j),
                    rid=f"g{gid}s{j}-{self._nonce}", group=f"g{gid}-{self._nonce}")
                for j in range(self.cfg.n_samples)])
        finally:
            self._free_slots(gid)
        text = self.decode(prompt.input_ids)
        items = [RewardItem(prompt=text, completion=self.decode(c.output_ids), prompt_ids=list(prompt.input_ids),
                            completion_ids=list(c.output_ids), solutions=list(prompt.solutions),
                            fields={**prompt.fields, "source": prompt.source}) for c in comps]
        async with self._reward_lock:
            rewards = await self.reward_fn(items)
        samples = [Sample(group=gid, prompt_ids=list(prompt.input_ids), output_ids=c.output_ids,
                          logprobs=c.logprobs, versions=_versions(c.versions),
                          reward=float(r), finish_reason=c.finish_reason["type"],
                          start_version=start_version, failovers=c.attempts, routed_experts=c.routed_experts)
                   for c, r in zip(comps, rewards)]
        if self.on_group is not None:
            self.on_group(samples)
        return samples

    async def _generate(self, gid: int, input_ids: list[int], sampling: SamplingParams, *, rid: str,
                        group: str) -> Completion:
        """One sample; its end frees a request slot for admission (``_admit``)."""
        try:
            return await self.client.generate(input_ids, sampling, rid=rid, group=group)
        finally:
            self._free_slots(gid, 1)

    # ---- synchronous mode --------------------------------------------------------------
    async def rollout_batch(self, prompts: list[Prompt], more: Callable[[], list[Prompt]] | None = None,
                            on_group: Callable[[list[Sample]], None] | None = None) -> RolloutBatch:
        """All groups of ``prompts`` with the current weights, at most
        ``max_concurrent_rollouts`` groups' worth of samples generating (see the module
        docstring). With ``dynamic_sampling`` (and
        ``more``, the next batch of prompts), groups with equal rewards are dropped and
        further rounds of ``more()`` prompts sampled until ``len(prompts)`` mixed groups
        are kept or ``dynamic_sampling_max_rounds`` rounds ran; the surplus is discarded.
        ``on_group`` sees each group as it lands (a progress bar)."""
        async def bounded(p: Prompt) -> list[Sample]:
            while self.generating + self.cfg.n_samples > self.cfg.in_flight:
                self._changed.clear()  # every waiter wakes on set(); each checks again
                await self._changed.wait()
            gid = self._next_group
            self._next_group += 1
            self._take_slots(gid)
            group = await self._group(gid, p, self.version)
            if on_group is not None:
                on_group(group)
            return group

        async def sample(batch: list[Prompt]) -> list[list[Sample]]:
            return list(await asyncio.gather(*[bounded(p) for p in batch]))

        if not (self.cfg.dynamic_sampling and more is not None):
            groups = await sample(prompts)
            self.consumed += len(groups)
            self.accepted += len(groups)
            return self._batch(groups)
        want, kept, seen, rounds, batch = len(prompts), [], 0, 0, prompts
        while True:
            groups = await sample(batch)
            rounds, seen = rounds + 1, seen + len(groups)
            kept += [g for g in groups if is_mixed(g)]
            if len(kept) >= want or rounds >= self.cfg.dynamic_sampling_max_rounds:
                break
            batch = more()
        self.dropped_uniform += seen - len(kept)
        # The ratio counts the groups that passed the filter, as async mode's does: the
        # surplus mixed groups are discarded for the batch's size, not for their rewards.
        mixed, kept = len(kept), kept[:want]
        self.consumed += len(kept)
        self.accepted += len(kept)
        return self._batch(kept, dynamic=(mixed, seen, float(rounds), want))

    # ---- async mode --------------------------------------------------------------------
    def capacity(self, batch_size: int) -> int:
        c = self.cfg
        return min((c.in_flight - self.generating) // c.n_samples,
                   (c.max_head_offpolicyness + self.version + 1) * batch_size
                   - (self.accepted + self.running))

    def start(self, prompts: Iterator[Prompt], batch_size: int) -> None:
        """Starts admitting groups from ``prompts`` in the background."""
        self._task = asyncio.ensure_future(self._admit(prompts, batch_size))

    async def _admit(self, prompts: Iterator[Prompt], batch_size: int) -> None:
        try:
            while True:
                if not self._paused:
                    for _ in range(max(0, self.capacity(batch_size))):
                        prompt = next(prompts, None)
                        if prompt is None:
                            return
                        self._launch(prompt)
                self._changed.clear()
                await self._changed.wait()
        except Exception as e:  # noqa: BLE001 - surfaced by prepare_batch
            self._error = e
            self._changed.set()

    def _launch(self, prompt: Prompt) -> None:
        gid, start = self._next_group, self.version
        self._next_group += 1
        self.running += 1
        self._take_slots(gid)
        task = asyncio.ensure_future(self._group(gid, prompt, start))
        self._groups.add(task)
        task.add_done_callback(functools.partial(self._landed, gid))

    def _landed(self, gid: int, task: asyncio.Task) -> None:
        self._groups.discard(task)
        self._free_slots(gid)  # a task cancelled before it ran never reached _group's own
        self.running -= 1
        if task.cancelled():
            return
        if task.exception() is not None:
            self._error = task.exception()
        elif self.cfg.dynamic_sampling:
            self._seen += 1
            if is_mixed(task.result()):
                self._kept += 1
                self.accepted += 1
                self._ready.append(task.result())
            else:  # never counted in accepted: frees capacity for a fresh group
                self.dropped_uniform += 1
        else:
            self.accepted += 1
            self._ready.append(task.result())
        self._changed.set()

    async def prepare_batch(self, batch_size: int) -> RolloutBatch:
        """Waits for ``batch_size`` groups fresh enough for the current version."""
        while True:
            if self._error is not None:
                raise self._error
            oldest = self.version - self.cfg.max_head_offpolicyness
            for group in [g for g in self._ready if g[0].start_version < oldest]:
                self._ready.remove(group)
                self.dropped_stale += 1
                self.accepted -= 1  # frees capacity for a fresh group
            # Dynamic sampling judges at most max_rounds x batch_size landed groups for a
            # batch; then it hands out what it has (possibly nothing, as sync mode may).
            cut = self.cfg.dynamic_sampling and self._seen >= self.cfg.dynamic_sampling_max_rounds * batch_size
            if len(self._ready) >= batch_size or cut:
                n = min(batch_size, len(self._ready))
                groups = [self._ready.popleft() for _ in range(n)]
                self.consumed += n
                self._changed.set()
                dynamic = None
                if self.cfg.dynamic_sampling:
                    dynamic = (self._kept, self._seen, self._seen / batch_size, batch_size)
                    self._seen = self._kept = 0
                return self._batch(groups, dynamic=dynamic)
            if self._task is not None and self._task.done() and not self._groups:
                raise PromptsExhausted(f"prompts ran out with {len(self._ready)} group(s) ready, "
                                       f"{batch_size} needed")
            self._changed.clear()
            await self._changed.wait()

    def set_version(self, version: int) -> None:
        """Call after the servers serve ``version``: admission then counts against it."""
        self.version = version
        self._changed.set()

    async def pause(self) -> None:
        """Stops admitting; running requests are aborted on the servers and resubmitted by
        the client, where they wait until ``resume``. Counters are untouched."""
        self._paused = True
        await self.client.pause(mode="abort")

    async def resume(self) -> None:
        await self.client.continue_()
        self._paused = False
        self._changed.set()

    async def stop(self) -> None:
        for task in [self._task, *self._groups]:
            if task is not None:
                task.cancel()
        await asyncio.gather(*[t for t in [self._task, *self._groups] if t], return_exceptions=True)

    def state_dict(self) -> dict:
        return {"version": self.version, "consumed": self.consumed, "next_group": self._next_group,
                "dropped_stale": self.dropped_stale, "dropped_uniform": self.dropped_uniform}

    def load_state_dict(self, state: dict) -> None:
        # Groups in flight at checkpoint time died with the process: only consumed ones count.
        self.version = state["version"]
        self.consumed = self.accepted = state["consumed"]
        self._next_group = state["next_group"]
        self.dropped_stale = state["dropped_stale"]
        self.dropped_uniform = state.get("dropped_uniform", 0)  # absent in checkpoints before it
        self._seen = self._kept = 0  # groups judged since the last batch died with the process

    # ---- batch + stats -----------------------------------------------------------------
    def _batch(self, groups: list[list[Sample]],
               dynamic: tuple[int, int, float, int] | None = None) -> RolloutBatch:
        """``dynamic``: (groups kept, groups sampled, rounds, groups wanted) of dynamic sampling."""
        samples = [s for g in groups for s in g]
        n = max(1, len(samples))
        lens = [len(s.output_ids) for s in samples] or [0]
        stale = [self.version - s.start_version for s in samples] or [0]
        rewards = [s.reward for s in samples] or [0.0]
        mean = sum(rewards) / n
        stats = {
            "rollout/n_samples": float(len(samples)),
            "rollout/response_len_mean": sum(lens) / n,
            "rollout/response_len_max": float(max(lens)),
            "rollout/prompt_len_mean": sum(len(s.prompt_ids) for s in samples) / n,
            "rollout/truncated_ratio": sum(s.finish_reason == "length" for s in samples) / n,
            "rollout/no_eos_ratio": sum(s.finish_reason != "stop" for s in samples) / n,
            "rollout/reward_mean": mean,
            "rollout/reward_std": (sum((r - mean) ** 2 for r in rewards) / n) ** 0.5,
            "rollout/accuracy": sum(r > 0 for r in rewards) / n,  # the boba reward is 1 when correct
            "rollout/generated_tokens": float(sum(lens)),
            "rollout/staleness_mean": sum(stale) / n,
            "rollout/staleness_max": float(max(stale)),
            "rollout/dropped_stale": float(self.dropped_stale),
            "rollout/failovers": float(sum(s.failovers for s in samples)),
        }
        if dynamic is not None:
            kept, seen, rounds, want = dynamic
            stats.update({"rollout/dynamic_kept_ratio": kept / max(1, seen),
                          "rollout/dynamic_rounds": rounds, "rollout/dynamic_groups": float(len(groups)),
                          "rollout/dropped_uniform": float(self.dropped_uniform)})
            if len(groups) < want:
                warnings.warn(
                    f"dynamic sampling: only {len(groups)} of {want} groups had mixed rewards after "
                    f"{seen} sampled (rollout.dynamic_sampling_max_rounds="
                    f"{self.cfg.dynamic_sampling_max_rounds}); this step trains on {len(groups)} groups. "
                    "Raise rollout.dynamic_sampling_max_rounds, or filter the prompts the model always or "
                    "never solves (areal-mcore filter difficulty)", RuntimeWarning, stacklevel=2)
        return RolloutBatch(samples=samples, version=self.version, stats=stats)
