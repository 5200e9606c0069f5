"""When the in-allocation launcher requeues its job, against an ``scontrol`` that answers as
Slurm 22.05's does. The real-cluster runs (test_slurm_launch.py) reach the cancelled case
only by a race: CI's run lost it, requeued a cancelled job, and that job then ran on for
four more tries, starving the next tests' jobs of CPUs."""

from __future__ import annotations

import datetime
import os
import time

import pytest

from areal_mcore.launcher import slurm

FAKE_SCONTROL = """#!/bin/sh
# show hostnames X | show node -o X | show job -o ID | requeue ID, as Slurm 22.05 prints them
case "$1 $2" in
  "show hostnames") echo node1 ;;
  "show node") echo "NodeName=node1 NodeAddr=127.0.0.1" ;;
  "show job") echo "JobId=$4 JobState=$(cat "$FAKE_DIR/state") TimeLimit=00:10:00 EndTime=$(cat "$FAKE_DIR/end")" ;;
  "requeue "*) echo "$2" >> "$FAKE_DIR/requeued" ;;
esac
"""


@pytest.fixture
def launcher(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(FAKE_SCONTROL)
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_DIR", str(tmp_path))
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node1")
    monkeypatch.setattr(os, "environ", os.environ.copy())  # the launcher exports NCCL's settings

    def job(state: str, end_in_s: float) -> None:
        end = datetime.datetime.fromtimestamp(time.time() + end_in_s).replace(microsecond=0)
        (tmp_path / "state").write_text(state)
        (tmp_path / "end").write_text(end.isoformat())

    job("RUNNING", 600)
    made = slurm.Launcher("configs/tiny_cpu.yaml", [f"trainer.log_dir={tmp_path}", "experiment_name=r"])
    made.end_time_read = float("-inf")  # the next _time_left() reads scontrol again
    return made, job, tmp_path / "requeued"


def test_a_running_job_near_its_limit_is_requeued(launcher):
    made, job, requeued = launcher
    job("RUNNING", 30)  # < launch.requeue_margin_s (60)
    assert made._time_limit_reached()
    assert made._requeue() == 0 and requeued.read_text().split() == ["7"]
    assert slurm.json.loads((made.slurm_dir / "status.json").read_text())["state"] == "REQUEUED"


@pytest.mark.parametrize("state", ["CANCELLED", "PREEMPTED", "PENDING"])
def test_a_job_slurm_no_longer_runs_is_not_requeued(launcher, state):
    """scancel: scontrol's EndTime becomes the moment of the cancel, 'a limit already past'."""
    made, job, requeued = launcher
    job(state, -3)
    assert not made._time_limit_reached() and made.terminating
    # The other way to requeue (the trainer exited 0 early) checks the state again.
    assert made._requeue() == 143 and not requeued.exists()
    assert slurm.json.loads((made.slurm_dir / "status.json").read_text())["state"] == "TERMINATED"
