"""Where the other ranks wait while rank 0 evaluates (trainer/ppo.py, PPORun.evaluate)."""

from __future__ import annotations

import pytest
from _dist import run_gloo


def _eval_rank(rank, world):
    import time
    from datetime import timedelta
    from types import SimpleNamespace

    import torch.distributed as dist

    from areal_mcore import collectives
    from areal_mcore.trainer.ppo import PPORun

    # On a GPU the groups the loop uses after the eval (the pipeline group, WORLD) are NCCL,
    # whose watchdog aborts a wait of 10-30 min; a gloo group with a 2 s timeout stands for them.
    nccl = dist.new_group(backend="gloo", timeout=timedelta(seconds=2))
    run = PPORun.__new__(PPORun)  # only what evaluate reads
    run.rank, run._signalled, run._in_rollout = rank, False, False
    run.cfg = SimpleNamespace(trainer=SimpleNamespace(eval_freq=1, total_steps=3))
    run.control = dist.new_group(backend="gloo", timeout=timedelta(seconds=120))

    def slow_eval():  # no eval row: nothing to log
        time.sleep(4)

    def failing_eval():
        raise ConnectionError("no server answered")

    run.rollout_side = SimpleNamespace(evaluate=slow_eval) if rank == 0 else None
    run.evaluate(step=1)
    collectives.barrier(nccl)  # what maybe_save does next (log's PP broadcast likewise)
    if rank == 0:
        run.rollout_side.evaluate = failing_eval
    try:
        run.evaluate(step=2)
    except Exception as e:  # noqa: BLE001 - the test compares what each rank raised
        return f"{type(e).__name__}: {e}"


@pytest.mark.multirank
def test_the_other_ranks_wait_out_rank_0s_eval_on_the_control_group():
    """Issue 42/5: rank 0 evaluates alone after the sync; the other ranks used to go on to
    log's pipeline broadcast and maybe_save's WORLD barriers and wait there, on NCCL groups
    whose watchdog a boba-length eval outlasts. An eval that fails ends every rank."""
    rank0, rank1 = run_gloo(_eval_rank, 2)
    assert rank0 == "ConnectionError: no server answered"
    assert rank1 == "RuntimeError: rank 0's eval after step 2 failed (ConnectionError: no server answered); " \
                    "see rank 0's log"
