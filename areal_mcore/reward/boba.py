"""boba reward: 1.0 if the last ``\\boxed{}`` answer matches any gold solution, else 0.0.

Runs inside a reward worker's main thread: math-verify's timeouts use ``signal.alarm``,
which only works there. Model text flows into sympy, so cheap guards reject answers no
real solution has (huge, deeply nested) before parsing, and parsed sympy objects are
never turned into strings outside a timeout.
"""

from __future__ import annotations

BOXED = ("\\boxed", "\\fbox")
MAX_ANSWER_CHARS = 1000
MAX_BRACE_DEPTH = 50


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox``) with balanced braces, if any."""
    start = max(text.rfind(tag + "{") for tag in BOXED)
    if start < 0:
        return None
    i = text.index("{", start)
    depth = 0
    for j in range(i, min(len(text), i + MAX_ANSWER_CHARS + 2)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None  # unbalanced, or longer than any real answer


def _gold(solution: str) -> str:
    """Gold answers are boxed solutions or bare LaTeX; bare LaTeX parses only inside $...$."""
    boxed = last_boxed(solution)
    return f"${boxed if boxed is not None else solution.strip()}$"


def _depth(text: str) -> int:
    depth = best = 0
    for ch in text:
        if ch == "{":
            depth += 1
            best = max(best, depth)
        elif ch == "}":
            depth -= 1
    return best


def boba_reward(completion: str, solutions: list[str], timeout_s: int = 3) -> float:
    """1.0 if the completion's last boxed answer verifies against any solution, else 0.0."""
    from math_verify import parse, verify

    answer = last_boxed(completion)
    if answer is None or not answer.strip() or _depth(answer) > MAX_BRACE_DEPTH:
        return 0.0
    pred = parse(f"\\boxed{{{answer}}}", parsing_timeout=timeout_s)
    if not pred:
        return 0.0
    for solution in solutions:
        gold = parse(_gold(solution), parsing_timeout=timeout_s)
        if gold and verify(gold, pred, timeout_seconds=timeout_s):
            return 1.0
    return 0.0


def boba_reward_fn(prompt: str, completion: str, prompt_ids: list[int], completion_ids: list[int],
                   solutions: list[str], *, timeout_s: int = 3, **fields) -> float:
    """``reward.fn``'s default: ``boba_reward`` in the dotted-path signature (``reward/fn.py``)."""
    return boba_reward(completion, solutions, timeout_s=timeout_s)
