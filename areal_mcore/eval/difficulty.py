"""boba's difficulty filter, sampling half: k samples per problem from a model (servers
launched as eval launches them, or running ones), scored by the boba reward; problems
solved k of k are dropped (boba: k = 8 from the base model).

Resumable: each finished problem is appended to ``<out>.samples.jsonl`` (its line in the
dataset, completions and rewards) as soon as its chunk lands, and a rerun with the same arguments
samples only the problems not in that file (a crash at problem 90 000 of 106 000 loses
at most one chunk). The kept rows are then copied byte for byte, as the scoring-only
filter (``data.filters.difficulty_filter``) does with precomputed samples.
"""

from __future__ import annotations

import asyncio
import json
from functools import partial
from pathlib import Path

from areal_mcore.data.filters import _kept_lines, _line
from areal_mcore.data.jsonl import load_problems
from areal_mcore.data.prompts import prompts_for
from areal_mcore.eval.config import FilterJob, eval_server_config, sampling


def read_done(path: Path) -> dict[int, list[float]]:
    """dataset line -> rewards of the problems a previous attempt finished. A last line torn by
    a kill is ignored (that problem is sampled again); a torn line elsewhere is an error."""
    if not path.is_file():
        return {}
    lines = path.read_text().splitlines()
    done = {}
    for i, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines):
                break
            raise ValueError(f"{path}:{i}: not a JSON row; delete the file to sample every problem again") from None
        done[row["line"]] = row["rewards"]
    return done


def _samples_path(out: str) -> Path:
    """Where sampling appends each finished problem: beside the kept rows."""
    return Path(out + ".samples.jsonl")


def filter_by_sampling(job: FilterJob) -> dict:
    """Samples the unfinished problems, then writes the kept rows; returns the counts."""
    from transformers import AutoTokenizer

    cfg, path = job.filter, _samples_path(job.filter.out)
    tokenizer = AutoTokenizer.from_pretrained(job.tokenizer_path)
    problems, report = load_problems(job.dataset)
    prompts = prompts_for(job.dataset, tokenizer, problems=problems).prompts
    if path.is_file():
        # Truncate a torn last line so the appends below start on a fresh line.
        text = path.read_text()
        if text and not text.endswith("\n"):
            path.write_text(text[:text.rfind("\n") + 1])
    done = read_done(path)
    todo = [p for p in prompts if _line(p.source) not in done]
    resumed = len(prompts) - len(todo)
    if resumed:
        print(f"[filter] resuming: {resumed} of {len(prompts)} problems already sampled in {path}", flush=True)
    if todo:
        done.update(_sample(job, tokenizer, todo, total=len(prompts), initial=resumed))
    solved = {s for s, rewards in done.items() if sum(r > 0.5 for r in rewards[:cfg.k]) >= cfg.k}
    keep = {_line(p.source) for p in prompts if _line(p.source) not in solved}
    kept = _kept_lines(Path(job.dataset.path), keep, Path(cfg.out))
    return {"problems": len(prompts), "kept": kept, "dropped_solved": len(prompts) - kept,
            "bad_rows": len(report.bad_rows), "sampled": len(todo), "resumed": resumed}


def _sample(job: FilterJob, tokenizer, todo, *, total: int, initial: int) -> dict[int, list[float]]:
    from tqdm import tqdm

    from areal_mcore.reward.pool import RewardPool
    from areal_mcore.rollout.auth import configured_key, launch_key
    from areal_mcore.rollout.episodes import EpisodeEnv
    from areal_mcore.rollout.servers import launch_servers

    servers, addresses, key = [], list(job.server.addresses), configured_key(job.server)
    bar = tqdm(total=total, initial=initial, desc="difficulty", unit="problem", disable=not job.filter.progress)
    try:
        if not addresses:
            server = eval_server_config(job.server)
            key = launch_key(server)  # the configured key, else one for these servers alone
            servers = launch_servers(server, default_log_dir=job.filter.out + "_servers",  # beside the output
                                     api_key=key)
            addresses = [s.address for s in servers]
        with RewardPool(job.reward) as pool:
            env = EpisodeEnv(score=pool.ascore, decode=partial(tokenizer.decode, skip_special_tokens=True),
                             encode=partial(tokenizer.encode, add_special_tokens=False), tools=pool.arun_tools)
            return asyncio.run(_sample_chunks(job, addresses, env, todo, bar, key))
    finally:
        bar.close()
        for s in servers:
            s.stop()


async def _sample_chunks(job: FilterJob, addresses, env, todo, bar, api_key: str | None) -> dict:
    from areal_mcore.rollout.client import ClientConfig, RolloutClient
    from areal_mcore.rollout.config import RolloutConfig
    from areal_mcore.rollout.episodes import make_episode
    from areal_mcore.rollout.executor import sample

    cfg, path = job.filter, _samples_path(job.filter.out)
    temperature, top_p = sampling(cfg)
    out: dict[int, list[float]] = {}
    path.parent.mkdir(parents=True, exist_ok=True)
    # The run's request policy where the config has a rollout section, else the defaults;
    # no connection cap (each chunk bounds its requests).
    policy = job.rollout or RolloutConfig(max_new_tokens=cfg.max_new_tokens)
    async with RolloutClient(ClientConfig.from_sections(policy, job.server, addresses=addresses, api_key=api_key,
                                                        max_connections=0)) as client:
        for start in range(0, len(todo), cfg.chunk):
            chunk = todo[start:start + cfg.chunk]
            # Seeded by the chunk's first line: the same run draws the same samples.
            rollout = RolloutConfig(max_new_tokens=cfg.max_new_tokens, n_samples=cfg.k, temperature=temperature,
                                    top_p=top_p, seed=cfg.seed * 1_000_003 + _line(chunk[0].source),
                                    max_concurrent_rollouts=cfg.chunk, episode=policy.episode,
                                    episode_args=policy.episode_args)
            batch = await sample(rollout, client, make_episode(rollout, env), chunk)
            with open(path, "a") as f:
                for i, p in enumerate(chunk):
                    group = batch.samples[i * cfg.k:(i + 1) * cfg.k]
                    rewards = [s.reward for s in group]
                    f.write(json.dumps({"line": _line(p.source), "completions": [env.decode(s.output_ids)
                                                                                 for s in group],
                                        "rewards": rewards}) + "\n")
                    out[_line(p.source)] = rewards
            bar.update(len(chunk))
    return out
