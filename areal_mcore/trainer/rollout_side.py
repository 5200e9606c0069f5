"""Global rank 0's half of the PPO run: what samples the batches.

Servers (launched here unless ``server.addresses`` names running ones), the client, the
training rollouts' executor, the reward pool, the prompt sampler and the held-out
evaluator. Built on rank 0 only; the other ranks train on what ``trainer.dispatch`` hands
them. Every call into the client and executors runs on the trainer's event-loop thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from functools import partial

from areal_mcore.algo.presets import describe
from areal_mcore.data.prompts import prompts_for
from areal_mcore.data.sampler import EpochSampler
from areal_mcore.reward.pool import RewardCounts, RewardPool
from areal_mcore.rollout.auth import configured_key, launch_key
from areal_mcore.rollout.client import ClientConfig, RolloutClient, relax_gc
from areal_mcore.rollout.episodes import EpisodeEnv, make_episode
from areal_mcore.rollout.executor import RolloutExecutor, sample
from areal_mcore.rollout.protocol import RolloutError
from areal_mcore.rollout.servers import launch_servers
from areal_mcore.rollout.trajectory import RolloutBatch
from areal_mcore.run_dir import RunDir
from areal_mcore.trainer.dispatch import SamplePacker
from areal_mcore.trainer.event_loop import LoopThread


class RolloutSide:
    """Samples each step's batch (``rollout``) and the held-out accuracy (``evaluate``);
    ``state_dict`` is what a resumed run needs to draw the same prompts next."""

    def __init__(self, cfg, tokenizer, run: RunDir, loop: LoopThread):
        """``cfg``: the ``ExperimentConfig`` (``dataset``, ``rollout``, ``server``, ``reward``,
        ``trainer`` and ``eval_dataset`` are read)."""
        self.cfg, self.loop = cfg, loop
        self.servers, self.pool, self.client, self.executor = [], None, None, None
        try:
            self._start(tokenizer, run)
        except BaseException:
            self.close()  # no server outlives a failed start
            raise

    def _start(self, tokenizer, run: RunDir) -> None:
        cfg, t = self.cfg, self.cfg.trainer
        train_set = prompts_for(cfg.dataset, tokenizer, max_prompt_tokens=t.max_prompt_tokens)
        self.prompts = train_set.prompts
        print(f"[ppo] {len(self.prompts)} prompts ({train_set.dropped_long} longer than "
              f"{t.max_prompt_tokens} tokens dropped); reward: {cfg.reward.fn}", flush=True)
        if cfg.algo:
            print(f"[ppo] {describe(cfg)}", flush=True)
        if len(self.prompts) < t.batch_size:  # the sampler would say so without naming the file
            raise ValueError(f"dataset.path={cfg.dataset.path}: {len(self.prompts)} usable prompts "
                             f"({train_set.dropped_long} longer than trainer.max_prompt_tokens="
                             f"{t.max_prompt_tokens} dropped), fewer than trainer.batch_size={t.batch_size}")
        self.sampler = EpochSampler(len(self.prompts), t.batch_size, cfg.seed)
        self.pool = RewardPool(cfg.reward)
        # The training rollouts' reward errors and timeouts (evals score through their own).
        self.reward_counts, self._counted = RewardCounts(), RewardCounts()
        self.decode = partial(tokenizer.decode, skip_special_tokens=True)
        self.env = EpisodeEnv(score=self.pool.ascore, decode=self.decode,
                              encode=partial(tokenizer.encode, add_special_tokens=False), tools=self.pool.arun_tools)
        # Built before any server starts: an episode that cannot work here (a tool-call
        # marker the tokenizer splits) says so first.
        episode = make_episode(cfg.rollout, dataclasses.replace(
            self.env, score=partial(self.pool.ascore, counts=self.reward_counts)))
        self.addresses = list(cfg.server.addresses)
        # Servers we launch take a key of this run's unless one is configured, and load
        # weights from disk only from under the run directory (docs/rollout.md#security);
        # servers someone else started (server.addresses) get the configured key, if any.
        self.api_key = configured_key(cfg.server)
        if not self.addresses:
            self.api_key = launch_key(cfg.server, run)
            self.servers = launch_servers(cfg.server, default_log_dir=str(run.servers),  # logs with the run
                                          api_key=self.api_key, weights_root=str(run.path.absolute()))
            self.addresses = [s.address for s in self.servers]
        relax_gc()  # rank 0's event loop parses every response (see relax_gc)
        self.client = RolloutClient(ClientConfig.from_sections(cfg.rollout, cfg.server, addresses=self.addresses,
                                                               api_key=self.api_key, model_path=cfg.model_path,
                                                               routed_experts=cfg.server.return_routed_experts))
        for server, process in zip(self.client.fleet.servers, self.servers):  # none with server.addresses
            server.owner_pid = process.proc.pid
        self.loop.run(self.client.start())
        self.executor = RolloutExecutor(cfg.rollout, self.client, episode, batch_size=t.batch_size,
                                        sync=t.mode == "sync")
        self.packer = SamplePacker()  # each group becomes arrays as it arrives (dispatch concatenates)
        self.executor.on_group = self.packer
        self.eval_prompts = []
        if cfg.eval_dataset is not None and t.eval_freq:
            # The prompts `areal-mcore eval --config` builds for the same file (one function).
            self.eval_prompts = prompts_for(cfg.eval_dataset, tokenizer,
                                            max_prompt_tokens=t.max_prompt_tokens).prompts

    def start_sampling(self) -> None:
        """Hands the executor the prompt stream, from where the restored sampler is: in
        ``trainer.mode=async`` sampling runs on during training, in ``sync`` each
        ``rollout`` samples a batch; each prompt is drawn as its group is admitted."""
        self.loop.call(self.executor.submit, self._prompt_stream())

    def _prompt_stream(self):
        while True:
            yield from (self.prompts[i] for i in self.sampler.next_batch())

    def rollout(self) -> RolloutBatch:
        """The next batch: sampled now (sync) or collected from the running stream (async),
        with the rewards scored 0.0 since the last batch for raising (``reward/errors``) or
        overrunning ``reward.timeout_s`` (``reward/timeouts``)."""
        out = self.loop.run(self.executor.wait(self.cfg.trainer.batch_size))
        now, before = dataclasses.replace(self.reward_counts), self._counted  # ints: a plain copy
        self._counted = now
        out.stats.update({"reward/errors": float(now.errors - before.errors),
                          "reward/timeouts": float(now.timeouts - before.timeouts)})
        return out

    def evaluate(self) -> dict | None:
        """Accuracy on the held-out problems (None without an eval set)."""
        if not self.eval_prompts:
            return None
        t = time.perf_counter()
        rollout = self.cfg.rollout
        # A fresh executor each time, with its own seed: evaluating never changes what
        # training samples, every eval draws the same seeds (its curve moves with the
        # weights only), and `areal-mcore eval` with the run's config draws them too.
        rollout = dataclasses.replace(rollout, seed=rollout.seed + 1)
        episode = make_episode(rollout, self.env)
        out = self.loop.run(sample(rollout, self.client, episode, self.eval_prompts))
        return {"eval/accuracy": out.stats["rollout/accuracy"], "eval/n_samples": out.stats["rollout/n_samples"],
                "eval/time_s": time.perf_counter() - t}

    def set_version(self, version: int) -> list:
        """Tags new samples with ``version``; returns the servers' weight versions."""
        self.loop.call(self.executor.set_version, version)
        return self.loop.run(self.client.weight_versions())

    def abort_all(self) -> None:
        """Best effort, bounded: the servers drop what an abandoned rollout asked for."""
        async def abort():
            with contextlib.suppress(RolloutError, asyncio.TimeoutError):
                await asyncio.wait_for(self.client.abort_all(), 10)
        self.loop.run(abort())

    def state_dict(self) -> dict:
        return {"sampler": self.loop.call(self.sampler.state_dict),
                "controller": self.loop.call(self.executor.state_dict)}  # the key checkpoints had

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state["sampler"])
        self.executor.load_state_dict(state["controller"])

    def close(self) -> None:
        if self.executor is not None:
            self.loop.run(self.executor.stop())
        if self.client is not None:
            self.loop.run(self.client.close())
        if self.pool is not None:
            self.pool.close()
        for s in self.servers:
            s.stop()
