"""The local 2-node Slurm cluster and the tiny boba run through the real Slurm launch path:
sbatch script -> in-allocation launcher -> rollout server step on node1 + trainer step on
node2; requeue (scontrol and time limit) resumes from the checkpoint; scancel leaves no
process behind; the submitit path returns the final stats; steps ask for their share of a
node. One module: its jobs share the cluster's two nodes, so they run one at a time (a
module runs on one xdist worker)."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
import uuid
from types import SimpleNamespace

import psutil
import pytest
from _runs import same_steps
from _slurm import REPO, TERMINAL, require, require_cluster, run, state, steps, wait

from areal_mcore.data.tiny_assets import TinyAssetsConfig, build_tiny_assets

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.server]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    require_cluster()
    out = tmp_path_factory.mktemp("slurm_assets")
    return build_tiny_assets(TinyAssetsConfig(out_dir=str(out), n_train=32, n_test=4, hidden_size=32,
                                              intermediate_size=64, num_layers=1))


def test_two_node_job_runs_a_step_on_each_node(tmp_path):
    """Smoke test of the cluster itself: a 2-node batch job runs one srun step on each node
    of its allocation, and accounting (sacct) reports the job and both steps COMPLETED."""
    require_cluster()

    out_file = tmp_path / "job.out"
    # The batch script records its allocation, then one step on each of its two nodes.
    script = 'echo "ALLOC $SLURM_JOB_NODELIST"; ' + "; ".join(
        f"srun --nodes=1 --ntasks=1 --relative={i} bash -c 'echo \"STEP $SLURMD_NODENAME\"'"
        for i in (0, 1)
    )
    job_id = (
        run(
            "sbatch",
            "--parsable",
            "--nodes=2",
            "--ntasks-per-node=1",
            "--time=5",
            "--job-name=pytest-slurm-local",
            f"--chdir={tmp_path}",
            f"--output={out_file}",
            f"--wrap={script}",
        )
        .strip()
        .split(";")[0]
    )

    state = wait(job_id, timeout_s=120)
    output = out_file.read_text() if out_file.exists() else "<no output file>"
    assert state == "COMPLETED", f"job {job_id} ended {state}; output:\n{output}"

    lines = [line.split() for line in output.splitlines()]
    alloc = [words[1] for words in lines if len(words) == 2 and words[0] == "ALLOC"]
    assert alloc, f"no allocation line in the job output:\n{output}"
    nodes = run("scontrol", "show", "hostnames", alloc[0]).split()
    assert len(nodes) == 2, f"job {job_id} was allocated {alloc[0]!r}, expected 2 nodes"
    stepped = [words[1] for words in lines if len(words) == 2 and words[0] == "STEP"]
    assert sorted(stepped) == sorted(nodes), (
        f"steps ran on {stepped}, expected one step on each of {nodes}:\n{output}"
    )

    # Both steps are in accounting too (records can trail the job's own by a moment).
    want = {f"{job_id}.0", f"{job_id}.1"}
    for _ in range(20):
        rows = run("sacct", "-n", "-P", "-j", job_id, "-o", "JobID,State").splitlines()
        steps = dict(row.split("|", 1) for row in rows if row)
        if all(steps.get(step) == "COMPLETED" for step in want):
            break
        time.sleep(0.5)
    assert all(steps.get(step) == "COMPLETED" for step in want), f"sacct steps: {steps}"


_cancel_at_teardown: list[str] = []  # the jobs a test submitted


@pytest.fixture(autouse=True)
def _cancel_leftover_jobs():
    """A test that fails (or runs into pytest-timeout) while its job runs leaves the job
    running, and the next test's job waits behind it (--exclusive) until its own waits run
    out: cancel what each test submitted."""
    yield
    if _cancel_at_teardown:
        subprocess.run(["scancel", *_cancel_at_teardown], capture_output=True)
        _cancel_at_teardown.clear()


def _submitted(sbatch_out: str) -> str:
    """The job id from ``sbatch --parsable``'s output, cancelled at the test's teardown."""
    job = sbatch_out.strip().split(";")[0]
    _cancel_at_teardown.append(job)
    return job


def _overrides(assets, log_dir, name, steps):
    return [f"experiment_name={name}", f"model_path={assets['model']}", f"dataset.path={assets['train']}",
            "trainer.eval_freq=0", f"trainer.total_steps={steps}", "trainer.batch_size=2", "trainer.save_freq=1",
            f"trainer.log_dir={log_dir}", "trainer.progress=false", "rollout.n_samples=2",
            "rollout.max_new_tokens=8", "ppo.reward_norm.group_size=2", "actor.mb_spec.max_tokens_per_mb=512",
            "reward.num_workers=1", "server.context_length=256", "doctor.on_launch=skip"]


def _sbatch(overrides, tmp_path, *flags, mark=""):
    env = {**os.environ, "CONFIG": "configs/tiny_cpu.yaml", "ALLOC": "embedded:d1+megatron:d1",
           "GPUS_PER_NODE": "1", "PY": sys.executable, "AREAL_TEST_MARK": mark}
    out = run("sbatch", "--parsable", "-N", "2", "--gpus-per-node=0", "--time=10",
              f"--output={tmp_path}/slurm-%j.out", *flags, "launch/slurm/boba_1.5b.sh", *overrides,
              cwd=REPO, env=env)
    return _submitted(out)


def _rows(run_dir):
    path = run_dir / "stats.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []


def _status(run_dir):
    return json.loads((run_dir / "slurm" / "status.json").read_text())


def _wait_rows(run_dir, n, job_id, timeout_s=300):
    """Until ``n`` steps are logged, ``timeout_s`` from the job's start (pending time is the
    queue's, not the run's)."""
    deadline = None
    while len(_rows(run_dir)) < n:
        st = state(job_id)
        if deadline is None and st not in ("", "PENDING"):
            deadline = time.monotonic() + timeout_s
        assert st not in TERMINAL and (deadline is None or time.monotonic() < deadline), \
            f"job {job_id} is {st} with {len(_rows(run_dir))} steps logged"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def uninterrupted(assets, tmp_path_factory):
    """A 6-step run launched through submitit, uninterrupted: the rows the requeued run
    must reproduce, and the submitit path's own result."""
    from areal_mcore.launcher.submit import SubmitConfig, submit

    tmp_path = tmp_path_factory.mktemp("uninterrupted")
    # The doctor on (as the sbatch default): submitit's job runs it first too.
    overrides = _overrides(assets, tmp_path, "submitit", 6)[:-1] + [
        *_NONZERO, "launch.allocation=embedded:d1+megatron:d1", "launch.gpus_per_node=1", "doctor.allreduce_mb=1",
        "doctor.checks=[storage,env,ports,network,fabric,slurm]"]
    cwd = os.getcwd()
    os.chdir(REPO)  # the job runs where it was submitted from
    try:
        (job,) = submit(SubmitConfig(config="configs/tiny_cpu.yaml", overrides=overrides, nodes=2,
                                     gpus_per_node=0, time="30:00", folder=str(tmp_path / "jobs")))
    finally:
        os.chdir(cwd)
    # 30 minutes: the time-limit warning (B:USR2@300) must not interrupt this run on a slow
    # machine (it came 5 minutes into a 10-minute limit in a loaded CI run).
    try:
        result = job.result()  # blocks until the job ends
    except BaseException:  # pytest-timeout included: do not leave it running
        subprocess.run(["scancel", job.job_id], capture_output=True)
        raise
    return SimpleNamespace(job=job, result=result, folder=tmp_path / "jobs",
                           rows=_rows(tmp_path / "submitit"))


# Advantages of -5 on every token (no normalisation: the tiny model's rewards are all 0), so
# every loss and grad norm depends on the exact weights; rollouts of ~1 s (0.15 s a decode
# step), so a signal sent once step 4 is logged lands in step 5.
_NONZERO = ["ppo.reward_norm=null", "ppo.adv_norm=null", "server.extra_args=[--step-delay-s,0.15]"]


def _stopped_at(log: str) -> int:
    """The step the trainer's stop checkpoint holds (its log: "... checkpointing step k")."""
    return int(log.rsplit("checkpointing step ", 1)[1].split()[0])


@pytest.mark.timeout(1200)  # the module's submitit run (its fixture) counts toward this test's time
def test_time_limit_warning_then_requeue_each_stop_at_a_checkpoint_and_the_run_resumes_bitwise(
        assets, uninterrupted, tmp_path):
    """One run interrupted twice, each interruption as Slurm makes it.

    1. The time-limit warning the boba scripts ask for (#SBATCH --signal=B:USR2@300: Slurm signals
       the batch shell, which exec'd the launcher), sent as Slurm sends it, with ``scancel
       --batch --signal=USR2``, once step 1 is logged, rather than by waiting out a
       one-minute --time (Slurm checks limits every ~30 s). The launcher asks the trainer to
       checkpoint and requeues the job itself; try 1 resumes from that checkpoint.
    2. ``scontrol requeue`` once try 1 has logged step 4 (and saved step 3: save_freq=3). It
       signals every process of every step (SIGTERM), not the trainer alone, and used to
       kill megatron's save helper (a spawned multiprocessing Manager) too, so the stop
       checkpoint of the last finished step failed (BrokenPipeError) and the next try went
       back to step 3. Try 2 resumes from the last finished step.

    The rows of the three tries are the uninterrupted run's, bitwise."""
    job = _sbatch([*_overrides(assets, tmp_path, "requeue", 6), *_NONZERO, "trainer.save_freq=3"], tmp_path)
    run_dir, out = tmp_path / "requeue", tmp_path / f"slurm-{job}.out"
    _wait_rows(run_dir, 1, job)
    run("scancel", "--batch", "--signal=USR2", job)
    deadline = time.monotonic() + 400
    while "requeueing job" not in (out.read_text() if out.exists() else ""):
        assert time.monotonic() < deadline and state(job) not in TERMINAL, state(job)
        time.sleep(0.5)
    assert "time limit near (SIGUSR2)" in out.read_text()
    warned_at = _stopped_at((run_dir / "slurm" / f"job{job}_try0" / "trainer.log").read_text())
    # The step logged, or the one under way when the signal came (or, on a loaded machine,
    # the next): try 1 logs step 4 whatever it was.
    assert 1 <= warned_at <= 3
    _wait_rows(run_dir, 4, job)
    assert (run_dir / "slurm" / f"job{job}_try1" / "trainer.log").is_file()
    run("scontrol", "requeue", job)
    assert wait(job, 400) == "COMPLETED", out.read_text()[-3000:]
    status = _status(run_dir)
    assert status["state"] == "COMPLETED" and status["restarts"] == 2 and status["step"] == 6
    # The job's .out shows launcher lines only: it names where the step progress is.
    assert f"[launcher] trainer log (step progress): {run_dir}/slurm/job{job}_try0/trainer.log" in out.read_text()
    logs = [(run_dir / "slurm" / f"job{job}_try{t}" / "trainer.log").read_text() for t in range(3)]
    requeued_at = _stopped_at(logs[1])
    after = logs[1].split("checkpointing step ", 1)[1]  # the stop checkpoint's save, and what followed it
    assert requeued_at >= 4 and not any(e in after for e in ("failed writing", "BrokenPipeError", "EOFError")), \
        logs[1][-3000:]
    for log, at in ((logs[1], warned_at), (logs[2], requeued_at)):
        assert f"step_{at:08d} at step {at}" in log, log[-2000:]  # "resumed from .../step_k at step k"
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 7)) and all(min(r["train/grad_norm"]) > 0 for r in rows)
    same_steps(rows, uninterrupted.rows)
    # Rollout server on the first node, trainer on the second (accounting's last try).
    st = steps(job)
    assert st["rollout0"][1] == "node1" and st["trainer"] == ("COMPLETED", "node2"), st
    assert (run_dir / "checkpoints" / "latest").is_file()
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))


def test_a_trainer_still_running_near_the_time_limit_is_stopped_and_the_job_requeued(assets, tmp_path):
    """A step longer than the warning (a boba step can take longer than 5 minutes) left
    the trainer running into the time limit: Slurm ended the job as TIMEOUT, which
    --requeue does not cover, and the run stopped for good. The launcher reads the job's
    EndTime, asks the trainer to stop stop_lead_s before it and, requeue_margin_s before
    it, stops the trainer and requeues the job itself. Here step 2's rollout never ends
    (the server's --stall-after fault), so the trainer cannot stop at a step's end; USR2
    would come only 1 s before the limit. The limit is cut (scontrol update, as an admin
    would; the launcher re-reads it) only once step 1 has ended: a stop request during
    step 1 is heeded at its end and the margin path goes untested, as it did in CI when a
    limit fixed at submission met a slow machine's step 1."""
    overrides = [*_overrides(assets, tmp_path, "margin", 100_000), "launch.stop_lead_s=80",
                 "launch.requeue_margin_s=60", "server.extra_args=[--stall-after,4]"]  # step 1: 2 prompts x 2 samples
    job = _sbatch(overrides, tmp_path, "--signal=B:USR2@1")
    run_dir, out = tmp_path / "margin", tmp_path / f"slurm-{job}.out"
    log = run_dir / "slurm" / f"job{job}_try1" / "trainer.log"
    try:
        _wait_rows(run_dir, 1, job)
        # Limits are whole minutes: the one that ends 75-135 s from now (stop_lead_s 80,
        # requeue_margin_s 60, and the launcher re-reads the limit every 15 s).
        elapsed = time.time() - _job_time(job, "StartTime")
        minutes = int(elapsed // 60) + 2 + (int(elapsed) % 60 > 45)
        run("scontrol", "update", f"JobId={job}", f"TimeLimit={minutes}")
        end = _job_time(job, "EndTime")
        assert 70 < end - time.time() < 140, (elapsed, minutes, end - time.time())
        requeued = None
        while not (log.exists() and "resumed from" in log.read_text()):
            if requeued is None and "requeueing job" in (out.read_text() if out.exists() else ""):
                requeued = time.time()
            assert time.time() < end + 120 and state(job) not in TERMINAL, \
                (state(job), out.read_text()[-3000:] if out.exists() else "")
            time.sleep(0.5)
    finally:
        subprocess.run(["scancel", job], check=False)
    text = out.read_text()
    # Requeued by the launcher before the limit (~60 s before, after up to 30 s for its
    # steps to stop), not by the USR2 at 1 s (the old launcher's only trigger, which the
    # stalled trainer would not have heeded anyway).
    assert requeued is not None and requeued < end - 10, (end - requeued if requeued else None, text[-3000:])
    stopping = "before the time limit: stopping it; the next try resumes from "
    assert stopping in text, text[-3000:]
    checkpoint = text.split(stopping, 1)[1].split()[0]
    assert int(checkpoint.rsplit("_", 1)[1]) == 1 and f"resumed from {checkpoint} at step 1" in log.read_text()
    assert "SIGUSR2" not in text and _status(run_dir)["restarts"] == 1
    wait(job, 120)


def _job_time(job, field):
    """The job's StartTime or EndTime (epoch seconds), as scontrol prints it in local time."""
    fields = dict(kv.split("=", 1) for kv in run("scontrol", "show", "job", "-o", job).split() if "=" in kv)
    return datetime.datetime.fromisoformat(fields[field]).timestamp()


def test_a_job_past_its_restart_budget_fails_with_the_reason(assets, tmp_path):
    """Node failures and preemptions requeue the job (Slurm does, with --requeue); the
    launcher refuses to start a try past launch.max_restarts instead of looping forever."""
    job = _sbatch(_overrides(assets, tmp_path, "budget", 100_000) + ["launch.max_restarts=0"], tmp_path)
    # Requeued as soon as the first try's launcher runs: the budget is checked when a try
    # starts, so steps of the first try prove nothing here.
    deadline = time.monotonic() + 240
    while not (tmp_path / "budget" / "slurm" / "status.json").is_file():
        assert time.monotonic() < deadline and state(job) not in TERMINAL, state(job)
        time.sleep(0.2)
    run("scontrol", "requeue", job)
    assert wait(job, 300) == "FAILED"
    status = _status(tmp_path / "budget")
    assert status["state"] == "FAILED" and status["restarts"] == 1
    assert status["error"] == "restarted 1 times, over launch.max_restarts=0"
    assert "over launch.max_restarts=0" in (tmp_path / f"slurm-{job}.out").read_text()


def _marked(mark: str) -> list[int]:
    """Processes whose environment carries the test's mark (inherited through sbatch,
    srun, torchrun and every child)."""
    pids = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("AREAL_TEST_MARK") == mark:
                pids.append(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return pids


def test_scancel_checkpoints_the_last_step_stops_every_step_and_leaves_no_process(assets, tmp_path):
    """``scancel`` (SIGTERM to every process of every step) with a checkpoint of step 2 on
    disk: the stop checkpoint of the last finished step is written (it failed with
    BrokenPipeError, leaving ``latest`` at step 2), and nothing is left running."""
    mark = uuid.uuid4().hex
    run_dir = tmp_path / "cancel"
    job = _sbatch([*_overrides(assets, tmp_path, "cancel", 50), *_NONZERO, "trainer.save_freq=2"], tmp_path,
                 mark=mark)
    _wait_rows(run_dir, 3, job)
    assert len(_marked(mark)) >= 4  # launcher, server, torchrun agent, trainer rank, ...
    run("scancel", job)
    assert wait(job, 120) == "CANCELLED"
    deadline = time.monotonic() + 60
    while _marked(mark):
        assert time.monotonic() < deadline, [psutil.Process(p).cmdline() for p in _marked(mark)]
        time.sleep(0.5)
    assert all(s in ("CANCELLED", "COMPLETED", "FAILED") for s, _ in steps(job).values()), steps(job)
    # Ended by the cancel, not failed, and not requeued (see test_launcher_requeue.py).
    assert _status(run_dir)["state"] == "TERMINATED" and state(job) == "CANCELLED"
    log = (run_dir / "slurm" / f"job{job}_try0" / "trainer.log").read_text()
    stopped_at = _stopped_at(log)
    assert stopped_at >= 3 and stopped_at == len(_rows(run_dir)), log[-3000:]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{stopped_at:08d}", log[-3000:]


def test_submitit_launch_completes_and_returns_the_final_stats(uninterrupted):
    result, job = uninterrupted.result, uninterrupted.job
    assert result["status"]["state"] == "COMPLETED"
    assert result["last_step"]["step"] == 6 and result["last_step"]["sync/server_versions"] == ["6"]
    assert wait(job.job_id, 60) == "COMPLETED"
    # Whole nodes with all their memory, as the sbatch headers ask (submitit writes only
    # the options it is given).
    script = (uninterrupted.folder / f"{job.job_id}_submission.sh").read_text()
    assert "#SBATCH --exclusive" in script and "#SBATCH --mem=0" in script, script
    doctor = json.loads((uninterrupted.folder.parent / "submitit" / "doctor.json").read_text())
    assert doctor["failed"] == [] and {"fabric.all_reduce", "slurm.requeue"} <= {c["name"] for c in doctor["checks"]}


def test_submitits_time_limit_signal_reaches_its_checkpoint_and_requeues(tmp_path):
    """submitit's batch script runs its command in bash (use_srun=False), and --signal=B:USR2
    signals the batch shell only: bash exited on it (its default action), so a submitit job
    reaching its time-limit warning ended FAILED instead of checkpointing and requeueing.
    Here the same executor as ``areal-mcore launch`` runs a probe (``LaunchJob``'s
    checkpoint contract, without a run) and gets USR2 as Slurm sends the warning."""
    import _submitit_probe
    import cloudpickle

    from areal_mcore.launcher.submit import SubmitConfig, executor

    require_cluster()
    cloudpickle.register_pickle_by_value(_submitit_probe)
    started = tmp_path / "started"
    cfg = SubmitConfig(config="", nodes=1, gpus_per_node=0, time="10:00", folder=str(tmp_path / "jobs"))
    job = executor(cfg, "probe").submit(_submitit_probe.Probe(str(started)))
    _cancel_at_teardown.append(job.job_id)
    deadline = time.monotonic() + 240
    while not started.exists():
        assert time.monotonic() < deadline and state(job.job_id) not in TERMINAL, state(job.job_id)
        time.sleep(0.2)
    run("scancel", "--batch", "--signal=USR2", job.job_id)
    assert wait(job.job_id, 240) == "COMPLETED", job.stderr()
    assert job.result() == {"tries": 2, "restart_count": "1"}


def test_sbatch_scripts_pass_bash_n_and_shellcheck():
    require("shellcheck", "shellcheck is not installed")
    scripts = sorted(str(p) for p in [*REPO.glob("launch/slurm/*.sh"), *REPO.glob("scripts/*.sh")])
    assert len(scripts) >= 6
    for path in scripts:
        subprocess.run(["bash", "-n", path], check=True)
    subprocess.run(["shellcheck", "-x", *scripts], check=True, cwd=REPO)


def test_srun_steps_run_with_their_gpus_share_of_cpus_and_memory(assets, tmp_path):
    # 2-CPU nodes, one "GPU" (process) per node, 4000 MB asked for the job on each node.
    # The doctor on, as sbatch runs it by default: its steps come first, on every node.
    overrides = [*_overrides(assets, tmp_path, "share", 1)[:-1], "doctor.allreduce_mb=4"]
    job = _sbatch(overrides, tmp_path, "--mem=4000")
    assert wait(job, 300) == "COMPLETED", (tmp_path / f"slurm-{job}.out").read_text()[-3000:]
    rows = run("sacct", "-n", "-P", "-j", job, "-o", "JobName,AllocCPUS,ReqMem,NodeList,Start,End").splitlines()
    got = {name: rest for name, *rest in (r.split("|") for r in rows if r)}
    assert got["rollout0"][0] == got["trainer"][0] == "2", got  # the node's CPUs / 1 GPU x 1
    assert got["doctor"][2] == "node[1-2]" and got["doctor-fabric"][2] == "node2", got
    assert got["doctor"][4] <= got["doctor-fabric"][3] and got["doctor-fabric"][4] <= got["rollout0"][3], got
    report = json.loads((tmp_path / "share" / "doctor.json").read_text())
    assert report["failed"] == [], report  # its time is measured (docs/slurm_admin.md), not asserted
    names = {(c["name"], c["where"]) for c in report["checks"] if c["state"] == "pass"}
    assert {("storage.rename", "node1"), ("storage.rename", "node2"), ("network.reach", "node2"),
            ("weight_sync.broadcast", "node1"), ("weight_sync.broadcast", "node2"), ("fabric.all_reduce", "job"),
            ("slurm.kill_wait", "job"), ("memory.plan", "job")} <= names, names
    # This cluster does not count memory (CR_Core: sacct shows no step memory), so the
    # flags are read from the launcher's log of each step's srun line.
    log = (tmp_path / f"slurm-{job}.out").read_text()
    for step in ("rollout0", "trainer"):
        line = next(x for x in log.splitlines() if x.startswith(f"[launcher] step {step}: srun "))
        assert " --exact --cpus-per-task=2 --mem=4000M" in line, line


def test_the_headers_gpus_per_node_does_not_give_one_server_step_the_whole_node(assets, tmp_path):
    """boba_*.sh asks ``#SBATCH --gpus-per-node=8``; sbatch exports SLURM_GPUS_PER_NODE,
    which every srun step reads as its own --gpus-per-node (srun's input environment), so
    the first server's step took every GPU of its node and the next waited ("Requested
    nodes are busy") until the startup timeout. Here: 2 fake GPUs per node, two t1 servers
    on node1, the trainer on node2, GPU flags on (as with SGLang)."""
    env = {**os.environ, "CONFIG": "configs/tiny_cpu.yaml", "ALLOC": "embedded:d2+megatron:d1",
           "GPUS_PER_NODE": "2", "PY": sys.executable}
    overrides = [*_overrides(assets, tmp_path, "gpus", 1), "launch.gpus=true",
                 "launch.server_startup_timeout_s=90"]
    job = _submitted(run("sbatch", "--parsable", "-N", "2", "--gpus-per-node=2", "--time=10",
                         f"--output={tmp_path}/slurm-%j.out", "launch/slurm/boba_1.5b.sh", *overrides,
                         cwd=REPO, env=env))
    ended = wait(job, 300)
    log = (tmp_path / f"slurm-{job}.out").read_text()
    assert ended == "COMPLETED", log[-3000:]
    st = steps(job)
    assert st["rollout0"][1] == st["rollout1"][1] == "node1" and st["trainer"][1] == "node2", st
    for step in ("rollout0", "rollout1", "trainer"):  # one GPU each (this cluster's accounting counts no gres)
        line = next(x for x in log.splitlines() if x.startswith(f"[launcher] step {step}: srun "))
        assert " --gpus-per-node=1 " in line, line


def test_a_two_node_trainer_starts_with_each_nodes_rank_and_the_masters_port(assets, tmp_path):
    """SFT (the 32B recipe's trainer-only stage) on megatron:d2 across node1 and node2: one
    torchrun per node, node ranks from the trainer's node list, the master port picked on
    the master node, a data-parallel pair across the two nodes."""
    env = {**os.environ, "CONFIG": "configs/tiny_cpu.yaml", "ALLOC": "megatron:d2", "GPUS_PER_NODE": "1",
           "PY": sys.executable}
    out_dir = tmp_path / "sft_model"
    overrides = ["experiment_name=sft2", f"trainer.log_dir={tmp_path}", f"dataset.path={assets['train']}",
                 f"sft.base_model={assets['model']}", f"sft.output_dir={out_dir}", "sft.steps=2",
                 "sft.batch_size=4", "launch.gpus=false"]  # CPU nodes (the doctor fails GPU steps without GPUs)
    job = _submitted(run("sbatch", "--parsable", "-N", "2", "--gpus-per-node=0", "--time=10",
                         f"--output={tmp_path}/slurm-%j.out", "launch/slurm/boba_32b.sh", *overrides,
                         cwd=REPO, env=env))
    assert wait(job, 300) == "COMPLETED", (tmp_path / f"slurm-{job}.out").read_text()[-3000:]
    assert steps(job)["trainer"] == ("COMPLETED", "node[1-2]"), steps(job)
    master = json.loads((tmp_path / "sft2" / "slurm" / "rendezvous" / "trainer_master.json").read_text())
    assert master["node"] == "node1"
    assert (out_dir / "config.json").is_file()
    # The doctor ran first (by default), its all-reduce across both trainer nodes as torchrun starts the trainer.
    fabric = next(c for c in json.loads((tmp_path / "sft2" / "doctor.json").read_text())["checks"]
                  if c["name"] == "fabric.all_reduce")
    assert fabric["state"] == "pass" and "over 2 ranks on 2 node(s)" in fabric["measured"], fabric


def test_a_killwait_below_the_checkpoint_lead_fails_the_doctor_and_starts_nothing(assets, tmp_path):
    """A requeued run whose steps took 50 s to train and 25 s to save: the 30 s KillWait of this
    cluster would SIGKILL it mid-save at scancel or preemption. The job fails in the doctor,
    before any server or trainer step."""
    run_dir = tmp_path / "killwait"
    run_dir.mkdir()
    (run_dir / "stats.jsonl").write_text(json.dumps({"step": 1, "time/train_s": 50.0, "time/save_s": 25.0}) + "\n")
    overrides = [*_overrides(assets, tmp_path, "killwait", 2)[:-1], "doctor.checks=[slurm]"]
    job = _sbatch(overrides, tmp_path)
    assert wait(job, 120) == "FAILED"
    log = (tmp_path / f"slurm-{job}.out").read_text()
    assert set(steps(job)) == {"boba-1.5b", "batch", "doctor"}, steps(job)  # no server, no trainer
    report = json.loads((run_dir / "doctor.json").read_text())
    assert len(report["failed"]) == 1 and report["failed"][0].startswith("FAIL slurm.kill_wait on job: KillWait 30 s "
                                                                         "(expected >= 75 s"), report["failed"]
    assert "the doctor failed (FAIL slurm.kill_wait" in log and "doctor.on_launch=warn" in log, log[-2000:]
