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
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from areal_mcore.data.filters import _kept_lines, _line
from areal_mcore.data.jsonl import DatasetConfig, load_problems
from areal_mcore.data.prompts import prompts_for
from areal_mcore.eval.config import (
    DEFAULT_MAX_NEW_TOKENS,
    MODEL_KINDS,
    SAMPLING_BY_KIND,
    eval_server_config,
)
from areal_mcore.reward.pool import RewardPoolConfig
from areal_mcore.rollout.config import ServerConfig


@dataclass(kw_only=True)
class DifficultyConfig:
    dataset: DatasetConfig  # a JSONL file: kept rows are copied byte for byte
    out: str  # kept rows (JSONL); progress in <out>.samples.jsonl
    server: ServerConfig  # model_path: the model sampled; addresses: servers already running
    k: int = 8
    model_kind: str = "base"  # boba samples the base model: 0.6/0.95
    temperature: float | None = None
    top_p: float | None = None
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    tokenizer_path: str | None = None  # None: server.model_path
    seed: int = 1
    chunk: int = 64  # problems in flight between two appends to the samples file
    reward: RewardPoolConfig = field(default_factory=RewardPoolConfig)
    progress: bool = True

    def __post_init__(self):
        if self.model_kind not in MODEL_KINDS:
            raise ValueError(f"model_kind={self.model_kind!r} is not allowed; choose one of {list(MODEL_KINDS)}")
        for key in ("k", "max_new_tokens", "chunk"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}={getattr(self, key)} must be >= 1")

    @property
    def samples_path(self) -> Path:
        return Path(self.out + ".samples.jsonl")

    def sampling(self) -> tuple[float, float]:
        temperature, top_p = SAMPLING_BY_KIND[self.model_kind]
        return (temperature if self.temperature is None else self.temperature,
                top_p if self.top_p is None else self.top_p)


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


def filter_by_sampling(cfg: DifficultyConfig) -> dict:
    """Samples the unfinished problems, then writes the kept rows; returns the counts."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer_path or cfg.server.model_path)
    problems, report = load_problems(cfg.dataset)
    prompts = prompts_for(cfg.dataset, tokenizer, problems=problems).prompts
    if cfg.samples_path.is_file():
        # Truncate a torn last line so the appends below start on a fresh line.
        text = cfg.samples_path.read_text()
        if text and not text.endswith("\n"):
            cfg.samples_path.write_text(text[:text.rfind("\n") + 1])
    done = read_done(cfg.samples_path)
    todo = [p for p in prompts if _line(p.source) not in done]
    resumed = len(prompts) - len(todo)
    if resumed:
        print(f"[filter] resuming: {resumed} of {len(prompts)} problems already sampled in {cfg.samples_path}",
              flush=True)
    if todo:
        done.update(_sample(cfg, tokenizer, todo, total=len(prompts), initial=resumed))
    solved = {s for s, rewards in done.items() if sum(r > 0.5 for r in rewards[:cfg.k]) >= cfg.k}
    keep = {_line(p.source) for p in prompts if _line(p.source) not in solved}
    kept = _kept_lines(Path(cfg.dataset.path), keep, Path(cfg.out))
    return {"problems": len(prompts), "kept": kept, "dropped_solved": len(prompts) - kept,
            "bad_rows": len(report.bad_rows), "sampled": len(todo), "resumed": resumed}


def _sample(cfg: DifficultyConfig, tokenizer, todo, *, total: int, initial: int) -> dict[int, list[float]]:
    from tqdm import tqdm

    from areal_mcore.reward.pool import RewardPool
    from areal_mcore.rollout.servers import launch_servers

    servers, addresses = [], list(cfg.server.addresses)
    bar = tqdm(total=total, initial=initial, desc="difficulty", unit="problem", disable=not cfg.progress)
    try:
        if not addresses:
            server = eval_server_config(cfg.server)
            servers = launch_servers(server, default_log_dir=cfg.out + "_servers")  # beside the output
            addresses = [s.address for s in servers]
        with RewardPool(cfg.reward) as pool:
            return asyncio.run(_sample_chunks(cfg, addresses, pool.ascore,
                                              partial(tokenizer.decode, skip_special_tokens=True), todo, bar))
    finally:
        bar.close()
        for s in servers:
            s.stop()


async def _sample_chunks(cfg: DifficultyConfig, addresses, reward_fn, decode, todo, bar) -> dict:
    from areal_mcore.rollout.client import ClientConfig, RolloutClient
    from areal_mcore.rollout.controller import RolloutConfig, RolloutController

    temperature, top_p = cfg.sampling()
    out: dict[int, list[float]] = {}
    cfg.samples_path.parent.mkdir(parents=True, exist_ok=True)
    async with RolloutClient(ClientConfig(addresses=addresses, api_key=cfg.server.api_key,
                                          backend=cfg.server.backend)) as client:
        for start in range(0, len(todo), cfg.chunk):
            chunk = todo[start:start + cfg.chunk]
            # Seeded by the chunk's first line: the same run draws the same samples.
            rollout = RolloutConfig(max_new_tokens=cfg.max_new_tokens, n_samples=cfg.k, temperature=temperature,
                                    top_p=top_p, seed=cfg.seed * 1_000_003 + _line(chunk[0].source),
                                    max_concurrent_rollouts=cfg.chunk)
            batch = await RolloutController(rollout, client, reward_fn, decode).rollout_batch(chunk)
            with open(cfg.samples_path, "a") as f:
                for i, p in enumerate(chunk):
                    group = batch.samples[i * cfg.k:(i + 1) * cfg.k]
                    rewards = [s.reward for s in group]
                    f.write(json.dumps({"line": _line(p.source), "completions": [decode(s.output_ids)
                                                                                 for s in group],
                                        "rewards": rewards}) + "\n")
                    out[_line(p.source)] = rewards
            bar.update(len(chunk))
    return out
