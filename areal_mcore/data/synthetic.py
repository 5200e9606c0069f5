"""A seeded synthetic arithmetic task, the CPU default in place of real math datasets.

Rows are boba format (``prompt``, ``solutions``) so they take the same loader path as
real data; the gold answer is ``\\boxed{...}``. Levels: 0 = one-digit addition (the tiny
CPU run's task: a 4-layer model learns it in minutes), 1 = two-digit addition and
subtraction, 2 = three-digit addition/subtraction and two-by-one-digit multiplication,
3 = a linear equation a·x + b = c with an integer root.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

LEVELS = (0, 1, 2, 3)
DEFAULT_LEVELS = (1, 2, 3)
SUFFIX = "Put the final answer in \\boxed{}."


def _problem(rng: random.Random, level: int) -> tuple[str, int]:
    if level == 0:
        a, b, op = rng.randint(0, 9), rng.randint(0, 9), "+"
    elif level == 1:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        op = rng.choice("+-")
    elif level == 2:
        op = rng.choice("+-*")
        a = rng.randint(100, 999) if op != "*" else rng.randint(10, 99)
        b = rng.randint(100, 999) if op != "*" else rng.randint(2, 9)
    else:
        x, a = rng.randint(-20, 20), rng.randint(2, 9)
        b = rng.randint(-50, 50)
        return f"Solve {a}x {'+' if b >= 0 else '-'} {abs(b)} = {a * x + b} for x.", x
    answer = {"+": a + b, "-": a - b, "*": a * b}[op]
    return f"Compute {a} {op} {b}.", answer


def generate(n: int, seed: int, levels: tuple[int, ...] = DEFAULT_LEVELS) -> list[dict]:
    """``n`` boba-format rows, the same for the same arguments."""
    bad = [lv for lv in levels if lv not in LEVELS]
    if bad or not levels:
        raise ValueError(f"levels={list(levels)} must be a non-empty subset of {list(LEVELS)}")
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        level = rng.choice(levels)
        question, answer = _problem(rng, level)
        rows.append({"prompt": f"{question} {SUFFIX}", "solutions": [f"\\boxed{{{answer}}}"],
                     "level": level})
    return rows


def write_jsonl(rows: list[dict], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
