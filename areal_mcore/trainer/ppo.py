"""The boba RL loop, synchronous mode: rollout -> rewards -> advantages -> train -> sync.

Every rank runs ``train(cfg)`` (torchrun or the tests' gloo spawner). Global rank 0 owns
the rollout side (servers, client, controller, reward pool) and hands each data-parallel
replica its share of the prompt groups; all ranks train and take part in weight sync.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from functools import partial
from pathlib import Path

import torch.distributed as dist

from areal_mcore.algo import ppo_actor_loss, reduce_ppo_stats
from areal_mcore.config import ExperimentConfig, PPOConfig
from areal_mcore.trainer.batch import to_train_batch
from areal_mcore.trainer.checkpoint import CheckpointConfig, Checkpointer


def ppo_loss(ppo: PPOConfig, logprobs_T, mb, num_global_tokens):
    """The actor's loss: clipped PPO against the recomputed proximal logprobs, with the
    behaviour (rollout) logprobs in the decoupled form when configured."""
    f = mb.fields
    return ppo_actor_loss(
        logprobs_T, f["prox"], f["adv"], f["loss_mask"], num_global_tokens=num_global_tokens,
        eps_clip=ppo.eps_clip, eps_clip_high=ppo.eps_clip_high, c_clip=ppo.c_clip,
        behave_logprobs_T=f["behave"] if ppo.use_decoupled_loss else None,
        behav_imp_weight_cap=ppo.behav_imp_weight_cap)


def train(cfg: ExperimentConfig) -> list[dict]:
    """Runs ``cfg.trainer.total_steps`` PPO steps; returns the per-step stats (rank 0)."""
    run = PPORun(cfg)
    try:
        run.evaluate(step=run.start_step)
        for step in range(run.start_step, cfg.trainer.total_steps):
            t0 = time.perf_counter()
            samples, rollout_stats = run.rollout()
            batch = to_train_batch(samples, cfg.ppo, dp_group=run.actor.groups.dp)
            batch.fields["prox"] = run.actor.compute_logprobs(batch)  # π_old of the ratio
            train_stats = run.actor.train_batch(batch, partial(ppo_loss, cfg.ppo),
                                                cfg.ppo.ppo_n_minibatches, reduce_stats=reduce_ppo_stats)
            sync_stats = run.sync(version=step + 1)
            run.log(step, rollout_stats, train_stats, sync_stats, time.perf_counter() - t0)
            run.evaluate(step=step + 1)
            run.maybe_save(step + 1)
    finally:
        run.close()
    return run.history


class PPORun:
    """The loop's collaborators, built from the config; one per rank."""

    def __init__(self, cfg: ExperimentConfig):
        from transformers import AutoConfig, AutoTokenizer

        from areal_mcore.actor import MegatronActor
        from areal_mcore.convert.hf_files import load_hf_state_dict
        from areal_mcore.weight_sync.syncer import WeightSyncer

        for section in ("model_path", "dataset", "rollout", "server", "trainer"):
            if getattr(cfg, section) is None:
                raise ValueError(f"training needs the config section/key {section!r}")
        self.cfg = cfg
        self.rank = dist.get_rank()
        self.run_dir = Path(cfg.trainer.log_dir) / cfg.experiment_name
        self.loop = asyncio.new_event_loop()
        self.history: list[dict] = []
        self.evals: list[dict] = []
        self.actor = MegatronActor(cfg.actor, AutoConfig.from_pretrained(cfg.model_path), seed=cfg.seed,
                                   total_optimizer_steps=cfg.trainer.total_steps * cfg.ppo.ppo_n_minibatches)
        self.actor.load_hf_state_dict(load_hf_state_dict(cfg.model_path))
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer_path or cfg.model_path)
        self.servers, self.pool, self.client, self.controller = [], None, None, None
        box = [None]
        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            box[0] = self._start_rollout()
        dist.broadcast_object_list(box, src=0, group=dist.group.WORLD)
        self.syncer = WeightSyncer(cfg.weight_sync, self.actor, box[0], api_key=cfg.server.api_key)
        self.loop.run_until_complete(self.syncer.connect())
        self.checkpointer = Checkpointer(CheckpointConfig(root=str(self.run_dir / "checkpoints")),
                                         group=dist.group.WORLD)
        resumed = self.checkpointer.load(self.actor)
        self.start_step = resumed.step if resumed else 0
        if resumed and self.rank == 0:
            self.sampler.load_state_dict(resumed.extra["sampler"])
            self.controller.load_state_dict(resumed.extra["controller"])
            print(f"[ppo] resumed from {resumed.path} at step {self.start_step}", flush=True)
        # Servers may hold anything (another run's weights, a base model): serve the actor's.
        self.sync(version=self.start_step)

    def _start_rollout(self) -> list[str]:
        from areal_mcore.data.jsonl import load_problems
        from areal_mcore.data.prompts import build_prompts
        from areal_mcore.data.sampler import EpochSampler
        from areal_mcore.reward.pool import RewardPool
        from areal_mcore.rollout.client import ClientConfig, RolloutClient
        from areal_mcore.rollout.controller import RolloutController
        from areal_mcore.rollout.launcher import launch_servers

        cfg = self.cfg
        problems, _ = load_problems(cfg.dataset)
        self.prompts, dropped = build_prompts(problems, self.tokenizer,
                                              max_prompt_tokens=cfg.trainer.max_prompt_tokens)
        print(f"[ppo] {len(self.prompts)} prompts ({dropped} longer than "
              f"{cfg.trainer.max_prompt_tokens} tokens dropped)", flush=True)
        self.sampler = EpochSampler(len(self.prompts), cfg.trainer.batch_size, cfg.seed)
        addresses = list(cfg.server.addresses)
        if not addresses:
            server_cfg = cfg.server
            if server_cfg.log_dir == "logs/rollout":  # the default: keep server logs with the run
                server_cfg = dataclasses.replace(server_cfg, log_dir=str(self.run_dir / "servers"))
            self.servers = launch_servers(server_cfg)
            addresses = [s.address for s in self.servers]
        self.pool = RewardPool(cfg.reward)
        self.client = RolloutClient(ClientConfig(addresses=addresses, api_key=cfg.server.api_key))
        self.loop.run_until_complete(self.client.start())
        decode = partial(self.tokenizer.decode, skip_special_tokens=True)
        self.controller = RolloutController(cfg.rollout, self.client, self.pool.ascore, decode)
        self.eval_prompts = []
        if cfg.eval_dataset is not None and cfg.trainer.eval_freq:
            self.eval_prompts, _ = build_prompts(load_problems(cfg.eval_dataset)[0], self.tokenizer,
                                                 max_prompt_tokens=cfg.trainer.max_prompt_tokens)
            # Its own counters and seeds: evaluating never changes what training samples.
            self.evaluator = RolloutController(dataclasses.replace(cfg.rollout, seed=cfg.rollout.seed + 1),
                                               self.client, self.pool.ascore, decode)
        return addresses

    def evaluate(self, step: int) -> None:
        """Accuracy on the held-out problems (rank 0; every ``trainer.eval_freq`` steps,
        before the first and after the last)."""
        freq, last = self.cfg.trainer.eval_freq, step == self.cfg.trainer.total_steps
        if self.rank != 0 or not self.eval_prompts or not (step % freq == 0 or last):
            return
        t = time.perf_counter()
        out = self.loop.run_until_complete(self.evaluator.rollout_batch(self.eval_prompts))
        row = {"step": step, "eval/accuracy": out.stats["rollout/reward_mean"],
               "eval/n_samples": out.stats["rollout/n_samples"], "eval/time_s": time.perf_counter() - t}
        self.evals.append(row)
        with open(self.run_dir / "eval.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"[eval] step {step}: accuracy {row['eval/accuracy']:.3f} over "
              f"{len(self.eval_prompts)} held-out problems x {self.cfg.rollout.n_samples} samples", flush=True)

    def rollout(self):
        """Rank 0 samples the batch; every rank returns its data-parallel share."""
        box = [None, None]
        if self.rank == 0:
            batch = [self.prompts[i] for i in self.sampler.next_batch()]
            out = self.loop.run_until_complete(self.controller.rollout_batch(batch))
            box = [out.samples, out.stats]
        dist.broadcast_object_list(box, src=0, group=dist.group.WORLD)
        samples, stats = box
        g, n = self.actor.groups, self.cfg.rollout.n_samples
        groups = [samples[i:i + n] for i in range(0, len(samples), n)]
        return [s for grp in groups[g.dp_rank::g.dp_size] for s in grp], stats

    def sync(self, version: int) -> dict:
        stats = self.loop.run_until_complete(self.syncer.push(version))
        out = {"sync/time_s": stats.total_s, "sync/bytes": float(stats.bytes)}
        if self.rank == 0:
            self.controller.set_version(version)
            versions = self.loop.run_until_complete(self.client.weight_versions())
            out["sync/server_versions"] = versions
        return out

    def maybe_save(self, step: int) -> None:
        """A checkpoint every ``trainer.save_freq`` steps and after the last one."""
        freq = self.cfg.trainer.save_freq
        if not freq or not (step % freq == 0 or step == self.cfg.trainer.total_steps):
            return
        extra = ({"sampler": self.sampler.state_dict(), "controller": self.controller.state_dict()}
                 if self.rank == 0 else None)
        self.checkpointer.save(self.actor, step=step, weight_version=step, extra=extra)

    def log(self, step: int, rollout_stats: dict, train_stats: dict, sync_stats: dict, step_s: float):
        row = {"step": step + 1, **rollout_stats, **sync_stats, "time/step_s": step_s,
               "train/loss": train_stats["loss"], "train/grad_norm": train_stats["grad_norm"],
               "train/time_s": train_stats["time_s"],
               **{f"train/{k}": float(v) for k, v in train_stats.get("stats", {}).items()}}
        self.history.append(row)
        if self.rank == 0:
            with open(self.run_dir / "stats.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
            print(f"[ppo] step {step + 1}/{self.cfg.trainer.total_steps} "
                  f"reward {rollout_stats['rollout/reward_mean']:.3f} "
                  f"len {rollout_stats['rollout/response_len_mean']:.1f} "
                  f"loss {sum(train_stats['loss']) / len(train_stats['loss']):+.4f} "
                  f"sync {sync_stats['sync/time_s']:.2f}s step {step_s:.1f}s", flush=True)

    def close(self) -> None:
        self.loop.run_until_complete(self.syncer.close())
        if self.client is not None:
            self.loop.run_until_complete(self.client.close())
        if self.pool is not None:
            self.pool.close()
        for s in self.servers:
            s.stop()
        self.loop.close()
        dist.barrier(group=dist.group.WORLD)
