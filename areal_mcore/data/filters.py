"""boba's dataset filters: drop problems the base model always solves, and long prompts.

Both keep the surviving rows byte-for-byte as they were in the input file.
"""

from __future__ import annotations

import json
from pathlib import Path

from areal_mcore.data.jsonl import DatasetConfig, load_problems


def _kept_lines(path: Path, keep: set[int], out: Path) -> int:
    out.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with open(path, "rb") as src, open(out, "wb") as dst:
        for lineno, raw in enumerate(src, 1):
            if lineno in keep:
                dst.write(raw if raw.endswith(b"\n") else raw + b"\n")
                n += 1
    return n


def _line(source: str) -> int:
    return int(source.rsplit(":", 1)[1])


def difficulty_filter(cfg: DatasetConfig, samples_path: str | Path, out: str | Path, *, k: int = 8,
                      pool=None) -> dict:
    """Drops problems whose k precomputed samples all score 1.0 (boba: k = 8).

    ``samples_path``: JSONL, one row per dataset problem in order, ``{"completions": [...]}``
    with at least k completions (the first k are used).
    """
    from areal_mcore.reward.pool import RewardPool

    problems, report = load_problems(cfg)
    rows = [json.loads(line) for line in Path(samples_path).read_text().splitlines() if line.strip()]
    if len(rows) != len(problems):
        raise ValueError(f"{samples_path}: {len(rows)} sample rows for {len(problems)} problems in {cfg.path}")
    for i, row in enumerate(rows, 1):
        if len(row.get("completions", [])) < k:
            raise ValueError(f"{samples_path}:{i}: needs at least k={k} completions")
    owned = pool is None
    pool = pool or RewardPool()
    try:
        rewards = pool.score([c for r in rows for c in r["completions"][:k]],
                             [p.solutions for p in problems for _ in range(k)])
    finally:
        if owned:
            pool.close()
    keep = {_line(p.source) for i, p in enumerate(problems) if sum(rewards[i * k : (i + 1) * k]) < k}
    kept = _kept_lines(Path(cfg.path), keep, Path(out))
    return {"problems": len(problems), "kept": kept, "dropped_solved": len(problems) - kept,
            "bad_rows": len(report.bad_rows)}


def length_filter(cfg: DatasetConfig, tokenizer, out: str | Path, *, max_prompt_tokens: int = 1024,
                  suffix: str | None = None) -> dict:
    """Drops problems whose chat-templated prompt exceeds ``max_prompt_tokens``."""
    from areal_mcore.data.prompts import build_prompts

    problems, report = load_problems(cfg)
    prompts, dropped = build_prompts(problems, tokenizer, max_prompt_tokens=max_prompt_tokens, suffix=suffix)
    kept = _kept_lines(Path(cfg.path), {_line(p.source) for p in prompts}, Path(out))
    return {"problems": len(problems), "kept": kept, "dropped_long": dropped, "bad_rows": len(report.bad_rows)}
