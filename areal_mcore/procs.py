"""Helper processes that end with the trainer, however it ends.

A trainer killed with SIGKILL (the OOM killer, Slurm after KillWait, ``kill -9``) runs no
cleanup, and its children are re-parented to init: servers, reward workers and
megatron's checkpoint-writer manager used to run on, holding GPUs and memory.
"""

from __future__ import annotations

import signal
import sys


def die_with_parent() -> None:
    """In a child (before exec, or first thing in a spawned process): SIGTERM when its
    parent dies. Linux sends it when the *thread* that started the child exits
    (prctl(2), PR_SET_PDEATHSIG), so start such children from a thread that lives as long
    as they should: the main thread, or the event-loop thread that owns them."""
    if sys.platform == "linux":
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
