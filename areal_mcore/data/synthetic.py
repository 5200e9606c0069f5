"""A seeded synthetic arithmetic task, the CPU default in place of real math datasets.

Rows are boba format (``prompt``, ``solutions``) so they take the same loader path as
real data; the gold answer is ``\\boxed{...}``. Levels: 0 = one-digit addition (the tiny
CPU run's task: a 4-layer model learns it in minutes), 1 = two-digit addition and
subtraction, 2 = three-digit addition/subtraction and two-by-one-digit multiplication,
3 = a linear equation a·x + b = c with an integer root, 4 = two-by-two-digit
multiplication (the tiny tool task's: too hard for the tiny model in its head, easy with a
calculator, ``rollout/episodes/tool_use.py``).

``generate(..., tool_demos=f)`` adds a ``lead`` column for the tool task's SFT warm-up
(``sft.response_template: "{lead}The answer is {solution}."``): a fraction f of the rows
lead with a calculator call and its result, the others with nothing (a direct answer).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

LEVELS = (0, 1, 2, 3, 4)
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
    elif level == 4:
        a, b, op = rng.randint(10, 99), rng.randint(10, 99), "*"
    else:
        x, a = rng.randint(-20, 20), rng.randint(2, 9)
        b = rng.randint(-50, 50)
        return f"Solve {a}x {'+' if b >= 0 else '-'} {abs(b)} = {a * x + b} for x.", x
    answer = {"+": a + b, "-": a - b, "*": a * b}[op]
    return f"Compute {a} {op} {b}.", answer


def generate(n: int, seed: int, levels: tuple[int, ...] = DEFAULT_LEVELS, tool_demos: float | None = None) -> list[dict]:
    """``n`` boba-format rows, the same for the same arguments (``tool_demos``: the
    fraction of rows whose ``lead`` is a calculator call; None: no ``lead`` column)."""
    bad = [lv for lv in levels if lv not in LEVELS]
    if bad or not levels:
        raise ValueError(f"levels={list(levels)} must be a non-empty subset of {list(LEVELS)}")
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        level = rng.choice(levels)
        question, answer = _problem(rng, level)
        row = {"prompt": f"{question} {SUFFIX}", "solutions": [f"\\boxed{{{answer}}}"], "level": level}
        if tool_demos is not None:
            expression = question.removeprefix("Compute ").removesuffix(".")
            row["lead"] = (f"<calc>{expression}</calc><out>{answer}</out> " if rng.random() < tool_demos else "")
        rows.append(row)
    return rows


def write_jsonl(rows: list[dict], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
