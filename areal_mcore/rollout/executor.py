"""The rollout executor: prompts in (``submit``), batches of trajectory groups out (``wait``).

It admits a group when ``rollout/admission.py`` says so, runs the configured episode on it
(``rollout/episodes/``), judges the landed group (dynamic sampling's ``accept``) and hands
groups out in batches. It knows the episode callable, never the reward pool or the
decoder. Sync mode (``trainer.mode=sync``, evals) is "submit a batch and wait": admission
opens only while a batch is waited for; async mode admits under AReaL's staleness bound
while the trainer trains. Both judge, drop and count in the same code, so dynamic sampling
exists once. Modelled on AReaL's ``areal/core/workflow_executor.py``.
"""

from __future__ import annotations

import asyncio
import functools
import uuid
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator

from areal_mcore.data.prompts import Prompt
from areal_mcore.rollout.admission import Admission
from areal_mcore.rollout.client import RolloutClient
from areal_mcore.rollout.config import RolloutConfig
from areal_mcore.rollout.episodes import Episode, GroupClient
from areal_mcore.rollout.trajectory import RolloutBatch, Sample, batch_stats, is_mixed


class PromptsExhausted(RuntimeError):
    """The prompts ended before a full batch was ready."""


class RolloutExecutor:
    def __init__(self, cfg: RolloutConfig, client: RolloutClient, episode: Episode, *, batch_size: int,
                 sync: bool = True, dynamic_sampling: bool | None = None):
        """``batch_size``: groups per batch (the staleness bound counts in batches).
        ``dynamic_sampling``: judge groups with DAPO's ``is_mixed`` (None: as
        ``cfg.dynamic_sampling``; evals pass False)."""
        self.cfg, self.client, self.episode = cfg, client, episode
        dynamic = cfg.dynamic_sampling if dynamic_sampling is None else dynamic_sampling
        self.accept: Callable[[list[Sample]], bool] | None = is_mixed if dynamic else None
        self.admission = Admission(
            width=cfg.n_samples, in_flight=cfg.in_flight, max_head_offpolicyness=cfg.max_head_offpolicyness,
            batch_size=batch_size, sync=sync,
            max_judged=cfg.dynamic_sampling_max_rounds * batch_size if dynamic else None)
        # Called with each landed group on the loop's thread, while others still generate
        # (the trainer packs samples into arrays there, off its dispatch path).
        self.on_group: Callable[[list[Sample]], None] | None = None
        self._nonce = uuid.uuid4().hex[:8]  # request ids stay unique across restarts
        self._sources: deque[Iterator[Prompt]] = deque()
        self._drained = False  # every submitted prompt was admitted
        self._ready: deque[tuple[int, int, list[Sample]]] = deque()  # (group id, admission version, group)
        self._changed = asyncio.Event()
        self._paused = False
        self._task: asyncio.Task | None = None
        self._groups: set[asyncio.Task] = set()
        self._error: BaseException | None = None

    # ---- in ----------------------------------------------------------------------------
    def submit(self, prompts: Iterable[Prompt]) -> None:
        """Queues ``prompts`` (a list, or an endless stream); each is drawn only when its
        group is admitted, so a stream's state says what was sampled. Call on the loop."""
        self._sources.append(iter(prompts))
        self._drained = False
        if self._task is None:
            self._task = asyncio.ensure_future(self._admit())
        self._changed.set()

    def _next_prompt(self) -> Prompt | None:
        while self._sources:
            prompt = next(self._sources[0], None)
            if prompt is not None:
                return prompt
            self._sources.popleft()
        self._drained = True
        return None

    async def _admit(self) -> None:
        try:
            while True:
                if not self._paused:
                    for _ in range(max(0, self.admission.capacity())):
                        prompt = self._next_prompt()
                        if prompt is None:
                            self._changed.set()  # a waiter may now see the prompts exhausted
                            break
                        self._launch(prompt)
                self._changed.clear()
                await self._changed.wait()
        except Exception as e:  # noqa: BLE001 - surfaced by wait
            self._error = e
            self._changed.set()

    def _launch(self, prompt: Prompt) -> None:
        a = self.admission
        gid = a.admit()
        client = GroupClient(self.client, group=gid, seed=self.cfg.seed, nonce=self._nonce,
                             free=functools.partial(self._free, gid))
        task = asyncio.ensure_future(self._run(client, prompt, a.version))
        self._groups.add(task)
        task.add_done_callback(functools.partial(self._landed, gid, a.version))

    def _free(self, gid: int, n: int | None = None) -> None:
        self.admission.free(gid, n)
        self._changed.set()

    async def _run(self, client: GroupClient, prompt: Prompt, version: int) -> list[Sample]:
        try:
            group = await self.episode.run(client, prompt, version)
        finally:
            self._free(client.group)  # every slot its samples still hold
        if self.on_group is not None:
            self.on_group(group)
        return group

    def _landed(self, gid: int, version: int, task: asyncio.Task) -> None:
        self._groups.discard(task)
        self.admission.land(gid)  # also frees a task's slots that was cancelled before it ran
        if task.cancelled():
            pass
        elif task.exception() is not None:
            self._error = task.exception()
        else:
            group = task.result()
            keep = self.accept is None or self.accept(group)
            self.admission.judge(keep)
            if keep:
                self._ready.append((gid, version, group))
        self._changed.set()

    # ---- out ---------------------------------------------------------------------------
    async def wait(self, n: int) -> RolloutBatch:
        """The next ``n`` groups fresh enough for the current version (sync mode: admitted
        now, in submission order; async: in landing order). With dynamic sampling, fewer
        once ``dynamic_sampling_max_rounds`` x batch size groups were judged for it.

        Raises:
            PromptsExhausted: the submitted prompts ended first.
        """
        a = self.admission
        a.wanted = n
        self._changed.set()
        try:
            while True:
                if self._error is not None:
                    raise self._error
                for item in [x for x in self._ready if a.stale(x[1])]:
                    self._ready.remove(item)
                    a.drop_stale()
                if len(self._ready) >= n or a.cut():
                    return self._batch(n)
                if self._drained and not self._groups:
                    raise PromptsExhausted(f"prompts ran out with {len(self._ready)} group(s) ready, {n} needed")
                self._changed.clear()
                await self._changed.wait()
        finally:
            a.wanted = 0

    def _batch(self, want: int) -> RolloutBatch:
        a = self.admission
        taken = [self._ready.popleft() for _ in range(min(want, len(self._ready)))]
        if a.sync:
            taken.sort(key=lambda x: x[0])  # submission order: groups are admitted in it
        kept, seen = a.kept, a.seen
        a.hand_out(len(taken))
        self._changed.set()
        samples = [s for _, _, group in taken for s in group]
        stats = {**batch_stats(samples, a.version), "rollout/dropped_stale": float(a.dropped_stale)}
        if self.accept is not None:
            stats.update({"rollout/dynamic_kept_ratio": kept / max(1, seen),
                          "rollout/dynamic_rounds": seen / a.batch_size, "rollout/dynamic_groups": float(len(taken)),
                          "rollout/dropped_uniform": float(a.dropped_uniform)})
            if len(taken) < want:
                warnings.warn(
                    f"dynamic sampling: only {len(taken)} of {want} groups had mixed rewards after "
                    f"{seen} sampled (rollout.dynamic_sampling_max_rounds="
                    f"{self.cfg.dynamic_sampling_max_rounds}); this step trains on {len(taken)} groups. "
                    "Raise rollout.dynamic_sampling_max_rounds, or filter the prompts the model always or "
                    "never solves (areal-mcore filter difficulty)", RuntimeWarning, stacklevel=3)
        return RolloutBatch(samples=samples, version=a.version, stats=stats)

    # ---- control -----------------------------------------------------------------------
    def set_version(self, version: int) -> None:
        """Call after the servers serve ``version``: admission then counts against it."""
        self.admission.version = version
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
        tasks = [t for t in [self._task, *self._groups] if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def state_dict(self) -> dict:
        return self.admission.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.admission.load_state_dict(state)


async def sample(cfg: RolloutConfig, client: RolloutClient, episode: Episode, prompts: list[Prompt],
                 on_group: Callable[[list[Sample]], None] | None = None) -> RolloutBatch:
    """Every prompt's group once, with the current weights, in prompt order (evals, the
    difficulty filter); never filtered by dynamic sampling."""
    ex = RolloutExecutor(cfg, client, episode, batch_size=max(1, len(prompts)), dynamic_sampling=False)
    ex.on_group = on_group
    try:
        ex.submit(prompts)
        return await ex.wait(len(prompts))
    finally:
        await ex.stop()
