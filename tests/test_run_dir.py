"""The run directory protocol: what the trainer writes is what the launchers read."""

import json

from areal_mcore.run_dir import RunDir, Status, checkpoint_name, checkpoint_step, point_latest_at


def test_a_stop_request_is_seen_once_and_cleared_for_the_next_try(tmp_path):
    run = RunDir(tmp_path)
    assert not run.take_stop()
    run.request_stop()  # the launcher on the time-limit signal
    assert run.take_stop() and not run.take_stop()  # the trainer consumes it
    run.request_stop()
    run.clear_stop()  # a new try drops a request made to the previous one
    assert not run.take_stop()
    run.clear_stop()  # nothing there: fine


def test_the_last_step_is_the_last_stats_row(tmp_path):
    run = RunDir(tmp_path)
    assert run.last_step() == 0 and run.stats_rows() == []
    for step in (1, 2, 3):
        run.append_stats({"step": step, "train/loss": [0.5, 0.25]})
    assert run.last_step() == 3
    assert [json.loads(line)["step"] for line in run.stats.read_text().splitlines()] == [1, 2, 3]


def test_the_latest_checkpoint_follows_the_pointer_the_checkpointer_writes(tmp_path):
    run = RunDir(tmp_path)
    assert run.latest_checkpoint() is None and run.checkpoint_step() == 0
    run.checkpoints.mkdir()
    point_latest_at(run.checkpoints, checkpoint_name(42))
    assert (run.checkpoints / "latest").read_text() == "step_00000042"
    assert run.latest_checkpoint() == run.checkpoints / "step_00000042"
    assert run.checkpoint_step() == 42 == checkpoint_step("/x/step_00000042")
    assert not list(run.checkpoints.glob(".*.tmp"))  # replaced by rename, no leftovers


def test_status_is_rewritten_whole_on_every_update(tmp_path):
    run = RunDir(tmp_path)
    run.slurm.mkdir()
    status = Status(run, job_id="7")
    status.update(state="STARTING", step=0)
    status.update(state="RUNNING")
    got = run.read_status()
    assert (got["job_id"], got["state"], got["step"]) == ("7", "RUNNING", 0) and "updated" in got
