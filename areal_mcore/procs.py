"""Helper processes that end with the trainer, however it ends.

A trainer killed with SIGKILL (the OOM killer, Slurm after KillWait, ``kill -9``) runs no
cleanup, and its children are re-parented to init: servers and reward workers used to
run on, holding GPUs and memory. And the
environment such a helper starts with: the trainer's, less what makes it a torchrun rank.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Mapping

# What torchrun's agent puts in each worker's environment: the names in
# torch/distributed/elastic/agent/server/local_elastic_agent.py::_start_workers and
# ::_set_local_rank_env (torch 2.13), and TORCHELASTIC_ERROR_FILE from
# elastic/multiprocessing/api.py::DefaultLogsSpecs.reify; every TORCHELASTIC_* is theirs.
# TORCH_NCCL_ASYNC_ERROR_HANDLING goes too: torchrun sets it to 1 where unset, and a
# server's own NCCL groups should run with torch's default, as when it starts alone.
_TORCHRUN_VARS = frozenset({
    "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
    "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
})


def die_with_parent() -> None:
    """In a child (before exec, or first thing in a spawned process): SIGTERM when its
    parent dies. Linux sends it when the *thread* that started the child exits
    (prctl(2), PR_SET_PDEATHSIG), so start such children from a thread that lives as long
    as they should: the main thread, or the event-loop thread that owns them."""
    if sys.platform == "linux":
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def child_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default ``os.environ``) without torchrun's per-worker variables: the
    environment for a helper process (a rollout server, a reward worker), which is no rank
    of the trainer's job.

    Why: with TORCHELASTIC_USE_AGENT_STORE=True inherited, a child's own ``tcp://``
    ``init_process_group`` (SGLang's TP group, at rank 0) never starts: torch's
    ``distributed/rendezvous.py::_create_c10d_store`` then makes *every* rank, rank 0 too,
    a client of a store it assumes torchrun's agent hosts at that address, so nobody hosts
    it and the child waits on connect until its timeout (``_torchelastic_use_agent_store``
    reads the variable). RANK, WORLD_SIZE, MASTER_* and the rest would tell any env://
    init in the child that it is a trainer rank. A helper started by the Slurm launcher
    (an srun step, no torchrun) never had them: this makes both launch paths alike."""
    env = os.environ if base is None else base
    return {k: v for k, v in env.items() if k not in _TORCHRUN_VARS and not k.startswith("TORCHELASTIC_")}
