"""``evaluate(job)``: n samples per problem from rollout servers, scored by the boba reward,
reported as pass@1 (averaged over samples) and unbiased pass@k per dataset.

Every dataset gets its own rollout executor seeded by ``eval.seed``, so a dataset's
samples depend on the seed and its problems only, not on which other datasets ran.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from functools import partial
from pathlib import Path

from areal_mcore.data.jsonl import DatasetConfig, load_problems
from areal_mcore.data.prompts import THINK, prompts_for, think_prefix  # noqa: F401 (re-exported)
from areal_mcore.eval.choices import shuffle_choices
from areal_mcore.eval.config import (
    EVAL_SGLANG_ARGS,
    EVAL_VLLM_ARGS,
    EvalConfig,
    EvalJob,
    check_full_attention,
    eval_server_config,
    sampling,
)
from areal_mcore.eval.passk import default_ks, pass_at_ks


def prompt_config(d: DatasetConfig, cfg: EvalConfig) -> tuple[DatasetConfig, list[str]]:
    """The dataset with the eval's opt-in prompt changes, and one line per change."""
    changes, new = [], {}
    if cfg.prompt_suffix is not None and cfg.prompt_suffix != d.instruction:
        new["instruction"] = cfg.prompt_suffix
        changes.append(f"instruction {cfg.prompt_suffix!r} instead of {d.instruction!r}")
    if cfg.think is not None and cfg.think != d.think:
        new["think"] = cfg.think
        changes.append(f"think={cfg.think} instead of {d.think}")
    return dataclasses.replace(d, **new), changes


def _prompts(d: DatasetConfig, job: EvalJob, tokenizer):
    cfg = job.eval
    d, changes = prompt_config(d, cfg)
    problems, _ = load_problems(d)
    if cfg.shuffle_choices:
        problems = shuffle_choices(problems, seed=cfg.seed)
    ps = prompts_for(d, tokenizer, max_prompt_tokens=cfg.max_prompt_tokens or 1 << 62, problems=problems)
    prompts, dropped = ps.prompts, ps.dropped_long
    if not prompts:
        raise ValueError(f"{d.path}: no problem left to evaluate ({dropped} longer than "
                         f"eval.max_prompt_tokens={cfg.max_prompt_tokens})")
    budget = max(len(p.input_ids) for p in prompts) + cfg.max_new_tokens
    if not job.server.addresses and budget > job.server.context_length:
        raise ValueError(f"{d.path}: the longest prompt plus eval.max_new_tokens={cfg.max_new_tokens} is {budget} "
                         f"tokens, over the servers' context_length={job.server.context_length}: lower "
                         f"eval.max_new_tokens or raise server.context_length")
    given = ", ".join(f"{n} x {t!r}" if t else f"{n} x none" for t, n in ps.instructions.items())
    print(f"[eval] {d.path}: prompts "
          + (f"DIFFER from training: {'; '.join(changes)}" if changes else "as in training")
          + f" (instruction {d.instruction!r}: {given}; response prefix {ps.response_prefix!r})", flush=True)
    return prompts, dropped, ps.response_prefix, changes


def evaluate(job: EvalJob) -> dict:
    """Samples, scores and reports every dataset; writes the report to ``eval.out`` if set.

    Returns:
        ``{"model", settings..., "datasets": [{"dataset", "problems", "pass@1", "pass@k"...}]}``.
    """
    from transformers import AutoTokenizer

    from areal_mcore.reward.pool import RewardPool
    from areal_mcore.rollout.episodes import EpisodeEnv

    cfg = job.eval
    tokenizer = AutoTokenizer.from_pretrained(job.tokenizer_path)
    # Data errors surface before any server starts.
    built = [(d, _prompts(d, job, tokenizer)) for d in job.datasets]
    data = [(d, prompts, dropped) for d, (prompts, dropped, _, _) in built]
    prefixes = sorted({prefix for _, (_, _, prefix, _) in built})
    changes = sorted({c for _, (*_, cs) in built for c in cs})
    servers = []
    try:
        servers, addresses, server_info, key = _servers(job)
        with RewardPool(job.reward) as pool:
            env = EpisodeEnv(score=pool.ascore, decode=partial(tokenizer.decode, skip_special_tokens=True),
                             encode=partial(tokenizer.encode, add_special_tokens=False), tools=pool.arun_tools)
            rows = asyncio.run(_sample(job, addresses, env, data, api_key=key))
    finally:
        for s in servers:
            s.stop()
    if len({r["dataset"] for r in rows}) < len(rows):  # same file name in two folders
        for r in rows:
            r["dataset"] = r["path"]
    temperature, top_p = sampling(cfg)
    report = {"model": job.server.model_path, "model_kind": cfg.model_kind, "n_samples": cfg.n_samples,
              "temperature": temperature, "top_p": top_p, "max_new_tokens": cfg.max_new_tokens,
              "seed": cfg.seed, "shuffle_choices": cfg.shuffle_choices, "prompt_suffix": cfg.prompt_suffix,
              "response_prefix": prefixes[0] if len(prefixes) == 1 else prefixes,
              "prompt_changes": changes, "servers": server_info, "datasets": rows}
    if cfg.out:
        Path(cfg.out).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.out).write_text(json.dumps(report, indent=2) + "\n")
    return report


def _servers(job: EvalJob) -> tuple[list, list[str], dict, str | None]:
    """(servers launched here, addresses, what the report says about them, their API key)."""
    from areal_mcore.rollout.auth import configured_key, launch_key
    from areal_mcore.rollout.servers import launch_servers

    if job.server.addresses:
        check_full_attention(job.server.model_path)
        print(f"[eval] using running servers {job.server.addresses}; boba's eval settings for SGLang "
              f"are {' '.join(EVAL_SGLANG_ARGS)} (set when they were started)", flush=True)
        return [], list(job.server.addresses), {"addresses": list(job.server.addresses)}, configured_key(job.server)
    server = eval_server_config(job.server)
    out = job.eval.out
    settings = (" ".join(EVAL_SGLANG_ARGS) if server.backend == "sglang" else
                " ".join(EVAL_VLLM_ARGS) if server.backend == "vllm" else
                "none needed (the embedded server is eager PyTorch with whole-prompt prefill and full attention)")
    print(f"[eval] starting {server.n_servers} {server.backend} server(s); eval settings: {settings}", flush=True)
    # Unless server.log_dir says otherwise, the logs go with the report.
    key = launch_key(server)  # the configured key, else one for these servers alone (docs/rollout.md#security)
    servers = launch_servers(server, default_log_dir=str(Path(out).with_suffix("")) + "_servers" if out else None,
                             api_key=key)
    return servers, [s.address for s in servers], {"backend": server.backend, "extra_args": server.extra_args}, key


async def _sample(job: EvalJob, addresses: list[str], env, data, *,
                  api_key: str | None = None) -> list[dict]:
    from tqdm import tqdm

    from areal_mcore.rollout.client import ClientConfig, RolloutClient
    from areal_mcore.rollout.config import RolloutConfig
    from areal_mcore.rollout.episodes import make_episode
    from areal_mcore.rollout.executor import sample

    cfg = job.eval
    temperature, top_p = sampling(cfg)
    rollout = RolloutConfig(max_new_tokens=cfg.max_new_tokens, n_samples=cfg.n_samples, temperature=temperature,
                            top_p=top_p, seed=cfg.seed, max_concurrent_rollouts=cfg.max_concurrent_rollouts,
                            **({"episode": job.rollout.episode, "episode_args": job.rollout.episode_args}
                               if job.rollout else {}))  # the run's task
    ks = cfg.ks or default_ks(cfg.n_samples)
    rows = []
    # The run's request policy where the config has a rollout section, else the defaults.
    async with RolloutClient(ClientConfig.from_sections(job.rollout or rollout, job.server, addresses=addresses,
                                                        api_key=api_key, max_connections=rollout.connections)) as client:
        for d, prompts, dropped in data:
            t0 = time.perf_counter()
            # stderr, as filter's and train's bars: the report lines stay on stdout.
            with tqdm(total=len(prompts), desc=Path(d.path).stem, unit="problem", disable=not cfg.progress) as bar:
                batch = await sample(rollout, client, make_episode(rollout, env), prompts,
                                     on_group=lambda _: bar.update())
            n = cfg.n_samples
            groups = [batch.samples[i:i + n] for i in range(0, len(batch.samples), n)]
            assert len(groups) == len(prompts) and all(len({s.group for s in g}) == 1 for g in groups)
            correct = [sum(s.reward > 0.5 for s in g) for g in groups]  # the boba reward is 1 or 0
            row = {"dataset": Path(d.path).stem, "path": d.path, "problems": len(prompts),
                   "dropped_long": dropped, "samples": len(batch.samples), **pass_at_ks(correct, n, ks),
                   "response_len_mean": batch.stats["rollout/response_len_mean"],
                   "truncated_ratio": batch.stats["rollout/truncated_ratio"],
                   "time_s": round(time.perf_counter() - t0, 3),
                   "per_problem": [{"source": p.source, "correct": c} for p, c in zip(prompts, correct)]}
            print(f"[eval] {row['dataset']}: pass@1 {row['pass@1']:.3f} over {len(prompts)} problems "
                  f"x {n} samples ({row['time_s']:.1f} s)", flush=True)
            rows.append(row)
    return rows


def format_table(report: dict) -> str:
    """One line per dataset: problems, samples per problem, pass@1 and every pass@k."""
    rows = report["datasets"]
    keys = [k for k in rows[0] if k.startswith("pass@")]
    width = max(len("dataset"), *(len(r["dataset"]) for r in rows))
    head = f"{'dataset':<{width}}  {'problems':>8}  {'n':>4}  " + "  ".join(f"{k:>8}" for k in keys)
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['dataset']:<{width}}  {r['problems']:>8}  {report['n_samples']:>4}  "
                     + "  ".join(f"{r[k]:>8.4f}" for k in keys))
    return "\n".join(lines)
