"""Shuffled multiple-choice options.

GPQA lists the correct answer first in every row, so unshuffled prompts reward a model
that always says 'A'. Each problem's options are permuted by a seed derived from the eval
seed and the problem's content (not its file path or position, so moving or renaming the
file keeps the permutation), and the gold letter follows its option.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random

from areal_mcore.data.jsonl import LETTERS, Problem


def _rng(seed: int, problem: Problem) -> random.Random:
    key = json.dumps([seed, problem.prompt, problem.choices], ensure_ascii=False)
    # sha256, not hash(): str hashes are salted per process.
    return random.Random(int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big"))


def shuffle_choices(problems: list[Problem], seed: int) -> list[Problem]:
    """Problems with options permuted (deterministic in ``seed`` and the problem) and the
    gold letter remapped; problems without options are returned unchanged."""
    out = []
    for p in problems:
        if not p.choices:
            out.append(p)
            continue
        order = list(range(len(p.choices)))
        _rng(seed, p).shuffle(order)  # order[new position] = old position
        gold = {LETTERS[order.index(LETTERS.index(s))] for s in p.solutions}
        out.append(dataclasses.replace(p, choices=tuple(p.choices[i] for i in order),
                                       solutions=tuple(sorted(gold))))
    return out
