"""The run directory protocol: what the trainer writes is what the launchers read."""

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _tmpfs import fill, tmpfs

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


def test_a_torn_last_line_is_dropped_and_a_damaged_one_is_named(tmp_path, capsys):
    run = RunDir(tmp_path)
    run.append_stats({"step": 1})
    with open(run.stats, "a") as f:
        f.write('{"step": 2, "rollout/reward_mean": 0.')  # cut short by a full disk or a kill
    assert run.stats_rows() == [{"step": 1}] and run.last_step() == 1
    assert f"{run.stats}:2: dropped a torn last line" in capsys.readouterr().err
    run.stats.write_text('{"step": 1}\n{"step": 2\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"stats.jsonl:2: not a JSON row"):
        run.stats_rows()


@pytest.fixture
def small_disk(tmp_path):
    with tmpfs(tmp_path / "disk", "256k") as mnt:
        yield mnt


def test_a_full_disk_leaves_no_torn_line_and_the_error_names_the_file(small_disk):
    run = RunDir(small_disk)
    run.append_stats({"step": 1})
    ballast = fill(small_disk, leave=2 * 4096)  # two pages left
    with pytest.raises(OSError, match=f"while appending to {run.stats}") as e:
        run.append_stats({"step": 2, "blob": "x" * 20_000})  # a row larger than what is free
    assert e.value.errno == errno.ENOSPC
    assert run.stats.read_text() == '{"step": 1}\n'  # cut back: no torn line
    ballast.unlink()  # space freed: the run goes on
    run.append_stats({"step": 2, "blob": "x" * 20_000})
    assert [r["step"] for r in run.stats_rows()] == [1, 2]


_TAKE_LOCK = "import sys, time; from areal_mcore.run_dir import RunDir; held = RunDir(sys.argv[1]).lock(); print('locked', flush=True); time.sleep(float(sys.argv[2]))"


def test_one_trainer_per_run_directory_and_a_dead_holders_lock_is_taken_over(tmp_path):
    run = RunDir(tmp_path / "run")
    held = run.lock()
    other = subprocess.run([sys.executable, "-c", _TAKE_LOCK, str(run.path), "0"], capture_output=True, text=True)
    assert other.returncode != 0 and f"run directory {run.path} is in use by pid {os.getpid()} on" in other.stderr
    held.close()
    killed = subprocess.Popen([sys.executable, "-c", _TAKE_LOCK, str(run.path), "60"], stdout=subprocess.PIPE, text=True)
    assert killed.stdout.readline().strip() == "locked"
    killed.kill()  # kill -9: the kernel releases its lock; the holder line stays behind
    killed.wait()
    run.lock().close()


_LOCK_AND_FORK = ("import os, sys, time; from areal_mcore.run_dir import RunDir; held = RunDir(sys.argv[1]).lock(); "
                  "child = os.fork()\nif child == 0: time.sleep(60); os._exit(0)\n"
                  "print(child, flush=True); time.sleep(60)")


def test_a_killed_holders_lock_is_free_while_a_child_it_forked_lives_on(tmp_path):
    """megatron's checkpoint writers are forked: with flock the child shared the lock and
    a run killed mid-save could not be resumed until that child ended."""
    run = RunDir(tmp_path / "run")
    holder = subprocess.Popen([sys.executable, "-c", _LOCK_AND_FORK, str(run.path)], stdout=subprocess.PIPE, text=True)
    child = int(holder.stdout.readline())
    try:
        holder.kill()
        holder.wait()
        os.kill(child, 0)  # the forked child still runs
        run.lock().close()
    finally:
        os.kill(child, 9)


def test_a_second_trainer_on_a_run_directory_is_refused_before_it_starts(tmp_path):
    from areal_mcore.data.tiny_assets import TinyAssetsConfig, build_tiny_assets

    assets = build_tiny_assets(TinyAssetsConfig(out_dir=str(tmp_path / "assets"), n_train=8, n_test=2,
                                                hidden_size=32, intermediate_size=64, num_layers=1))
    held = RunDir(tmp_path / "tiny-cpu").lock()
    try:
        out = subprocess.run([sys.executable, "-m", "areal_mcore.cli", "train", "--config", "configs/tiny_cpu.yaml",
                              f"trainer.log_dir={tmp_path}", "server.backend=embedded",
                              f"model_path={assets['model']}", f"dataset.path={assets['train']}",
                              f"eval_dataset.path={assets['test']}"],
                             capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[1])
    finally:
        held.close()
    assert out.returncode == 2, out.stderr[-3000:]
    assert f"is in use by pid {os.getpid()}" in out.stderr and "another experiment_name" in out.stderr
    assert not (tmp_path / "tiny-cpu" / "servers").exists()  # nothing was started


def test_the_last_rows_are_read_from_the_end_of_the_file(tmp_path):
    run = RunDir(tmp_path)
    for step in range(1, 2001):
        run.append_stats({"step": step, "blob": "x" * 100})
    assert [r["step"] for r in run.stats_tail(5)] == [1996, 1997, 1998, 1999, 2000]
    assert run.last_step() == 2000 and [r["step"] for r in run.stats_tail(3000)] == list(range(1, 2001))
    with open(run.stats, "a") as f:
        f.write('{"step": 2001, "bl')  # being appended right now
    assert run.last_step() == 2000


def test_the_disk_sync_exports_under_the_run_directory_only(tmp_path):
    """The servers a run launches load from its directory only (--weights-root), so the
    disk sync never points them elsewhere: weight_sync.disk_dir is taken from the run
    directory, and one outside it is refused naming the key."""
    from areal_mcore.checks import FieldError
    from areal_mcore.weight_sync.disk import export_dir

    run = tmp_path / "run"
    run.mkdir()
    (run / "out").symlink_to(tmp_path)
    assert export_dir("export", str(run)) == str(run / "export")
    assert export_dir(str(run / "a" / "b"), str(run)) == str(run / "a" / "b")
    for outside in (str(tmp_path / "export"), "../export", "out/export", "/tmp/x"):
        with pytest.raises(FieldError, match=rf"weight_sync.disk_dir='{outside}' is outside the run directory"):
            export_dir(outside, str(run))
    assert export_dir("/tmp/x", None) == "/tmp/x"  # a syncer outside a run (the tests') as given


def test_an_earlier_finished_or_unresumable_run_is_refused_unless_a_flag_says_what_to_do(tmp_path):
    """A README-style rerun with the same experiment_name silently set aside a finished
    run's stats and overwrote its curves. "auto" still resumes a checkpoint short of
    total_steps (a stopped run rerun, a requeued job)."""
    run = RunDir(tmp_path / "x")
    assert run.earlier_run_refusal(5, "auto") is None  # nothing there yet
    run.path.mkdir()
    for step in (1, 2, 3):
        run.append_stats({"step": step})
    why = run.earlier_run_refusal(5, "auto")
    assert why.startswith(f"{run.path} holds an earlier run's stats (3 steps) and no checkpoint to resume: "
                          "--resume (trainer.existing_run=resume) starts afresh") and "--overwrite" in why
    assert run.earlier_run_refusal(5, "resume") is None
    run.checkpoints.mkdir()
    point_latest_at(run.checkpoints, checkpoint_name(3))
    assert run.earlier_run_refusal(5, "auto") is None  # resumed at step 3
    assert run.earlier_run_refusal(3, "auto") is None  # ended before its final export: resumed to write it
    (run.path / "hf" / "step_3").mkdir(parents=True)
    (run.path / "hf" / "step_3" / "config.json").write_text("{}")
    why = run.earlier_run_refusal(3, "auto")
    assert "holds a finished run (its checkpoint of step 3, and trainer.total_steps=3): trainer.total_steps " \
           "above 3 trains it on; --overwrite" in why
    (run.path / "curves.png").write_bytes(b"png")
    (run.path / "rollout_api_key").write_text("k")
    aside = run.set_aside()
    assert sorted(p.name for p in aside.iterdir()) == ["checkpoints", "curves.png", "hf", "stats.jsonl"]
    assert sorted(p.name for p in run.path.iterdir()) == sorted([aside.name, "rollout_api_key"])
    assert run.earlier_run_refusal(3, "auto") is None and run.set_aside() is None


def test_the_cli_refuses_a_rerun_of_a_finished_run_before_anything_starts(tmp_path):
    from areal_mcore.data.tiny_assets import TinyAssetsConfig, build_tiny_assets

    assets = build_tiny_assets(TinyAssetsConfig(out_dir=str(tmp_path / "assets"), n_train=8, n_test=2,
                                                hidden_size=32, intermediate_size=64, num_layers=1))
    run = RunDir(tmp_path / "tiny-cpu")
    run.path.mkdir()
    run.append_stats({"step": 5})
    run.checkpoints.mkdir(parents=True)
    point_latest_at(run.checkpoints, checkpoint_name(5))
    (run.path / "hf" / "step_5").mkdir(parents=True)
    (run.path / "hf" / "step_5" / "config.json").write_text("{}")
    out = subprocess.run([sys.executable, "-m", "areal_mcore.cli", "train", "--config", "configs/tiny_cpu.yaml",
                          f"trainer.log_dir={tmp_path}", "server.backend=embedded", "trainer.total_steps=5",
                          f"model_path={assets['model']}", f"dataset.path={assets['train']}",
                          f"eval_dataset.path={assets['test']}"],
                         capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[1])
    assert out.returncode == 2, out.stderr[-3000:]
    assert "holds a finished run (its checkpoint of step 5, and trainer.total_steps=5)" in out.stderr
    assert not (run.path / "servers").exists() and run.stats_rows() == [{"step": 5}]  # nothing started or moved
