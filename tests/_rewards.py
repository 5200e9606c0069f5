"""Reward functions given by dotted path (``reward.fn=_rewards:...``) in the tests; the
reward workers import them from this folder (``reward/fn.py::import_root``)."""

from __future__ import annotations


def parity_reward(prompt, completion, prompt_ids, completion_ids, solutions, **fields):
    """1.0 for an odd number of completion tokens, 0.0 for an even one; raises on a multiple
    of 4 (a buggy reward: the sample scores 0.0 and is counted in reward/errors). The
    dataset row's other columns arrive as fields (the tiny task's ``level``), with ``source``."""
    assert prompt and isinstance(prompt_ids[0], int) and solutions and fields["source"]
    assert isinstance(fields["level"], int), fields
    if len(completion_ids) % 4 == 0:
        raise RuntimeError(f"{len(completion_ids)} tokens")
    return float(len(completion_ids) % 2)


def too_few_args(completion, solutions):
    return 0.0


not_a_function = 3


def first_token_reward(prompt, completion, prompt_ids, completion_ids, solutions, **fields):
    """1.0 when the first completion token's id is a multiple of 5: about one sample in five
    for an untrained model, so a group of 4 is uniform (all 0 or all 1) about 41 % of the
    time and mixed otherwise, as DAPO's dynamic sampling needs, with no SFT warm-up."""
    return float(bool(completion_ids) and completion_ids[0] % 5 == 0)


def noisy_reward(prompt, completion, prompt_ids, completion_ids, solutions, **fields):
    """parity of the completion's length, after printing to stdout, to fd 1 and to stderr:
    the worker's answers must not be broken by what a reward function prints."""
    import os
    import sys

    print("a reward function's debug line")
    os.write(1, b"straight to fd 1\n")
    print("and stderr", file=sys.stderr)
    return float(len(completion) % 2)


def hanging_tool(args):
    import time

    time.sleep(60)


def raising_tool(args):
    raise RuntimeError(f"no tool for {args!r}")


def chatty_tool(args):
    """Prints a megabyte and returns nothing: the observation is its (cut) output."""
    import os

    print("x" * (1 << 20))
    os.write(1, b"y" * (1 << 20))  # fd 1 is /dev/null in a worker


def greedy_tool(args):
    """Allocates past the workers' address-space limit."""
    return len(bytearray(4 << 30))
