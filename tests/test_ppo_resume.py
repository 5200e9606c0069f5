"""Kill a 2-rank PPO run mid-way, resume it from its checkpoint: the per-step rewards and
losses equal those of an uninterrupted run (sync mode, bitwise on CPU)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from types import SimpleNamespace

import _tiers
import psutil
import pytest
from _dist import _worker, rank_context, run_gloo
from _rollout import embedded_servers
from _runs import same_steps
from _tmpfs import fill, tmpfs

from areal_mcore.config import load_config
from areal_mcore.data.tiny_assets import TinyAssetsConfig, build_tiny_assets
from areal_mcore.net import free_port

pytestmark = [pytest.mark.server, pytest.mark.multirank]

STEPS = 4


def _ppo_worker(rank, world, overrides):
    from areal_mcore.trainer.ppo import train

    return train(load_config(None, overrides))


def _ppo_worker_printing_to(rank, world, overrides, path):
    """``_ppo_worker`` with its console in ``path`` (the forkserver's ranks print to the
    descriptors it started with, which no capture fixture sees)."""
    with open(f"{path}.{rank}", "w") as out, contextlib.redirect_stdout(out):
        return _ppo_worker(rank, world, overrides)


def _overrides(assets, address, log_dir):
    return [
        "experiment_name=resume", f"model_path={assets['model']}",
        "actor.mb_spec.max_tokens_per_mb=512", "actor.optimizer.lr=1e-3", "actor.vocab_divisible_by=8",
        f"dataset.path={assets['train']}", "rollout.max_new_tokens=12", "rollout.n_samples=4",
        "server.model_path=${model_path}", f"server.addresses=[{address}]",
        "weight_sync.dtype=float32", "weight_sync.master_address=127.0.0.1", "reward.num_workers=1",
        f"trainer.total_steps={STEPS}", "trainer.batch_size=2", "trainer.save_freq=1",
        f"trainer.log_dir={log_dir}", "ppo.reward_bias=-0.5", "ppo.reward_scaling=10.0",
        "ppo.ppo_n_minibatches=2",
    ]


def _rows(path):
    import json

    return [json.loads(line) for line in path.read_text().splitlines()]


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE  # an orphan's zombie waits for init's wait()
    except psutil.NoSuchProcess:
        return False


def _cmdline(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:  # gone, or a zombie
        return ""


def _tiny_assets(root):
    return build_tiny_assets(TinyAssetsConfig(out_dir=str(root / "assets"), n_train=32, n_test=4,
                                              hidden_size=32, intermediate_size=64, num_layers=1))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 1-layer model, one embedded server, and the uninterrupted run's rows that the
    interrupted ones must reproduce bitwise (sampling seeds depend on the prompt group and
    sample only, so a failed-over or resumed sample is drawn the same on any server)."""
    root = tmp_path_factory.mktemp("tiny")
    assets = _tiny_assets(root)
    with embedded_servers(assets["model"], str(root / "logs")) as (server,):
        (rows,) = run_gloo(_ppo_worker, 1, [*_overrides(assets, server.address, root / "ref"), "trainer.save_freq=0"])
        yield SimpleNamespace(assets=assets, server=server, reference=rows)


@pytest.mark.slow
def test_killed_run_resumes_with_the_same_rewards_and_losses(tmp_path):
    assets = build_tiny_assets(TinyAssetsConfig(out_dir=str(tmp_path / "assets"), n_train=64, n_test=8,
                                                hidden_size=64, intermediate_size=128, num_layers=2))
    with embedded_servers(assets["model"], str(tmp_path / "logs")) as servers:
        address = servers[0].address
        run_gloo(_ppo_worker, 2, _overrides(assets, address, tmp_path / "a"))
        reference = _rows(tmp_path / "a" / "resume" / "stats.jsonl")
        # Without reward normalisation every response token has advantage -5: updates are
        # not zero, and the second minibatch's loss and every grad norm depend on the
        # exact weights, so a wrong resume shows in the numbers.
        assert all(r["train/loss"][1] != r["train/loss"][0] for r in reference)

        # The same run, killed (SIGKILL, every rank) once two steps are logged.
        overrides = _overrides(assets, address, tmp_path / "b")
        stats = tmp_path / "b" / "resume" / "stats.jsonl"
        ctx, port = rank_context(), free_port()
        queue = ctx.Queue()
        procs = [ctx.Process(target=_worker, args=(r, 2, port, _ppo_worker, (overrides,), queue,
                                                       _tiers.marks(), dict(os.environ)))
                 for r in range(2)]
        for p in procs:
            p.start()
        deadline = time.time() + 300
        while not (stats.exists() and len(stats.read_text().splitlines()) >= 2):
            assert time.time() < deadline and all(p.exitcode is None for p in procs)
            time.sleep(0.05)
        # kill -9 of the ranks alone: what they started (reward workers; no checkpoint
        # helper since the save's results queue is in-process) must go with them.
        family = {c: _cmdline(c) for p in procs for c in psutil.Process(p.pid).children(recursive=True)}
        for p in procs:
            p.kill()
            p.join()
        killed = time.monotonic()
        assert any("areal_mcore.reward.worker" in line for line in family.values()), family
        assert not any("spawn_main" in line for line in family.values()), family  # no Manager
        while (alive := [c for c in family if _alive(c)]) and time.monotonic() < killed + 10:
            time.sleep(0.1)
        for c in alive:
            c.kill()
        assert not alive, [family[c] for c in alive]
        killed_at = len(_rows(stats))
        assert killed_at < STEPS

        resumed = run_gloo(_ppo_worker, 2, overrides)  # from the latest complete checkpoint
    rows = _rows(stats)
    # A step logged before the kill but not checkpointed runs again, and its first row is
    # dropped on resume: one row per step.
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    by_step = {r["step"]: r for r in rows}
    for ref in reference:
        got = by_step[ref["step"]]
        assert got["rollout/reward_mean"] == ref["rollout/reward_mean"], ref["step"]
        assert got["train/loss"] == ref["train/loss"], ref["step"]
        assert got["train/grad_norm"] == ref["train/grad_norm"], ref["step"]
        assert got["rollout/response_len_mean"] == ref["rollout/response_len_mean"]
    first_after = resumed[0][0]["step"]
    assert 1 < first_after <= killed_at + 1  # resumed from a checkpoint, not from scratch
    # TensorBoard agrees: the killed run's events past the checkpoint were purged.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(stats.parent / "tensorboard"))
    acc.Reload()
    events = acc.Scalars("rollout/reward_mean")
    assert [e.step for e in events] == list(range(1, STEPS + 1))
    assert [e.value for e in events] == pytest.approx([r["rollout/reward_mean"] for r in reference])


def test_a_run_goes_on_when_one_of_two_servers_dies(tiny, tmp_path):
    """kill -9 of one of two servers after step 2: generation fails over to the survivor,
    and the next weight sync drops the dead one (it raised WeightSyncError and the run
    ended) and goes on to the survivor alone."""
    with embedded_servers(tiny.assets["model"], str(tmp_path / "logs"), n=2) as servers:
        overrides = [*_overrides(tiny.assets, f"{servers[0].address},{servers[1].address}", tmp_path),
                     "trainer.save_freq=0"]
        stats = tmp_path / "resume" / "stats.jsonl"

        def kill_after_two_steps():
            deadline = time.time() + 300
            while not (stats.exists() and len(stats.read_text().splitlines()) >= 2) and time.time() < deadline:
                time.sleep(0.05)
            servers[1].proc.kill()

        killer = threading.Thread(target=kill_after_two_steps, daemon=True)
        killer.start()
        (rows,) = run_gloo(_ppo_worker, 1, overrides)
        killer.join()
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert rows[0]["sync/server_versions"] == ["1", "1"]
    assert rows[-1]["sync/server_versions"] == [str(STEPS)]  # the survivor, at every step's weights
    same_steps(rows, tiny.reference)


def test_sigterm_mid_rollout_checkpoints_the_last_step_at_once_and_the_run_resumes_exactly(tiny, tmp_path):
    """Slurm's scancel or preemption sends SIGTERM and SIGKILL KillWait (30 s) later. The
    signal was acted on only at the end of the step, so a rollout of minutes (here: one
    that never ends, the server stalled) was killed without a checkpoint. Now the rollout
    is abandoned and the last finished step checkpointed at once; the resumed run's steps
    are the uninterrupted run's."""
    stats = tmp_path / "resume" / "stats.jsonl"
    # Step 1 asks 2 prompts x 4 samples; every generate request after those stalls.
    with embedded_servers(tiny.assets["model"], str(tmp_path / "a"), n=1,
                          extra_args=["--stall-after", "8"]) as (stalled,):
        overrides = [*_overrides(tiny.assets, stalled.address, tmp_path), "trainer.save_freq=0"]
        ctx, port = rank_context(), free_port()
        queue = ctx.Queue()
        proc = ctx.Process(target=_worker, args=(0, 1, port, _ppo_worker, (overrides,), queue,
                                                 _tiers.marks(), dict(os.environ)))
        proc.start()
        deadline = time.time() + 300
        while not (stats.exists() and len(stats.read_text().splitlines()) >= 1):
            assert time.time() < deadline and proc.exitcode is None
            time.sleep(0.05)
        time.sleep(1.0)  # in step 2's rollout, which never ends
        signalled = time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)
        queue.get(timeout=60)  # the run returned
        proc.join(30)
        took = time.monotonic() - signalled
    print(f"SIGTERM mid-rollout: checkpointed and exited after {took:.1f} s")
    assert proc.exitcode == 0 and took < 20, (proc.exitcode, took)
    assert (tmp_path / "resume" / "checkpoints" / "latest").read_text().strip() == "step_00000001"
    (rows,) = run_gloo(_ppo_worker, 1, [*_overrides(tiny.assets, tiny.server.address, tmp_path),
                                        "trainer.save_freq=0"])
    assert [r["step"] for r in rows] == [2, 3, 4]  # from the checkpoint of step 1
    assert [r["step"] for r in _rows(stats)] == [1, 2, 3, 4]
    same_steps(_rows(stats), tiny.reference)


def test_a_full_disk_ends_the_run_naming_the_file_and_once_freed_the_run_resumes_exactly(tiny, tmp_path):
    """The run directory's disk fills up after step 1's checkpoint: the run ends with
    ENOSPC naming what it was writing; with space freed it resumes from that checkpoint
    (a cut stats.jsonl line used to make every later resume fail on a JSON error)."""
    with tmpfs(tmp_path / "disk", "64m") as disk:
        overrides = _overrides(tiny.assets, tiny.server.address, disk)  # a checkpoint every step
        run = disk / "resume"
        ballast = []

        def fill_after_step_one():
            deadline = time.time() + 300
            while not (run / "checkpoints" / "latest").exists() and time.time() < deadline:
                time.sleep(0.005)
            ballast.append(fill(disk))

        filler = threading.Thread(target=fill_after_step_one, daemon=True)
        filler.start()
        with pytest.raises(AssertionError, match="No space left on device") as failed:
            run_gloo(_ppo_worker, 1, overrides)
        filler.join()
        print(str(failed.value)[-600:])
        assert f"{run}/" in str(failed.value)  # the file it was writing
        assert not list((run / "checkpoints").glob(".step_*.tmp"))
        ballast[0].unlink()
        (rows,) = run_gloo(_ppo_worker, 1, overrides)
        assert 1 < rows[0]["step"]  # resumed from a checkpoint
        assert [r["step"] for r in _rows(run / "stats.jsonl")] == [1, 2, 3, 4]
        same_steps(_rows(run / "stats.jsonl"), tiny.reference)


def test_a_run_goes_on_when_one_of_two_servers_stalls(tiny, tmp_path):
    """SIGSTOP of one of two servers after step 1 (a hung engine: its connections stay
    open, nothing answers): requests waited there for rollout.request_timeout_s (an
    hour) and the next sync's pause for ever. Now they go to the other server once it
    answered nothing for stall_after_s and /health neither, and the sync drops it."""
    with embedded_servers(tiny.assets["model"], str(tmp_path / "logs"), n=2) as servers:
        overrides = [*_overrides(tiny.assets, f"{servers[0].address},{servers[1].address}", tmp_path),
                     "trainer.save_freq=0", "rollout.stall_after_s=2", "rollout.stall_probe_s=3"]
        stats = tmp_path / "resume" / "stats.jsonl"

        def stop_after_one_step():
            deadline = time.time() + 300
            while not (stats.exists() and stats.read_text().strip()) and time.time() < deadline:
                time.sleep(0.02)
            os.kill(servers[1].proc.pid, signal.SIGSTOP)

        stopper = threading.Thread(target=stop_after_one_step, daemon=True)
        stopper.start()
        try:
            t = time.monotonic()
            (rows,) = run_gloo(_ppo_worker, 1, overrides)
            took = time.monotonic() - t
        finally:
            stopper.join()
            os.kill(servers[1].proc.pid, signal.SIGCONT)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert rows[-1]["sync/server_versions"] == [str(STEPS)] and took < 120, took
    same_steps(rows, tiny.reference)


def test_with_its_only_server_stalled_the_run_checkpoints_and_ends_naming_it(tiny, tmp_path):
    with embedded_servers(tiny.assets["model"], str(tmp_path / "logs"), n=1) as (server,):
        overrides = [*_overrides(tiny.assets, server.address, tmp_path), "trainer.save_freq=0",
                     "rollout.stall_after_s=2", "rollout.stall_probe_s=3"]
        stats = tmp_path / "resume" / "stats.jsonl"

        def stop_after_one_step():
            deadline = time.time() + 300
            while not (stats.exists() and stats.read_text().strip()) and time.time() < deadline:
                time.sleep(0.02)
            os.kill(server.proc.pid, signal.SIGSTOP)

        stopper = threading.Thread(target=stop_after_one_step, daemon=True)
        stopper.start()
        try:
            with pytest.raises(AssertionError, match=rf"no healthy rollout server among \['{server.address}'\]"):
                run_gloo(_ppo_worker, 1, overrides)
        finally:
            stopper.join()
            os.kill(server.proc.pid, signal.SIGCONT)
    assert (tmp_path / "resume" / "checkpoints" / "latest").read_text().strip() == "step_00000001"


def test_a_reward_fn_by_dotted_path_trains_a_run_and_the_drift_alarm_stays_quiet(tiny, tmp_path):
    """reward.fn from a test module scores every sample in the workers (its raises score 0
    and are counted per step), and on the servers' own weights the train-vs-rollout gap is
    fp32 noise, far under the alarm's threshold."""
    import json

    overrides = [*_overrides(tiny.assets, tiny.server.address, tmp_path), "trainer.save_freq=0",
                 "trainer.total_steps=2", "trainer.dump_to_file=true", "reward.fn=_rewards:parity_reward",
                 "trainer.max_rollout_logprob_gap=1e-3"]
    (rows,) = run_gloo(_ppo_worker_printing_to, 1, overrides, str(tmp_path / "console"))
    assert [r["step"] for r in rows] == [1, 2]
    assert "; reward: _rewards:parity_reward\n" in (tmp_path / "console.0").read_text()  # the run says which
    for row in rows:
        dumped = [json.loads(line) for line in
                  (tmp_path / "resume" / "rollouts" / f"step_{row['step']}.jsonl").read_text().splitlines()]
        lens = [d["response_len"] for d in dumped]
        assert [d["reward"] for d in dumped] == [0.0 if n % 4 == 0 else float(n % 2) for n in lens]
        assert row["reward/errors"] == sum(n % 4 == 0 for n in lens) and row["reward/timeouts"] == 0
        assert row["rollout/reward_mean"] == pytest.approx(sum(d["reward"] for d in dumped) / len(dumped))
        # Every response token is measured, all sampled by the weights being trained (sync mode).
        assert row["drift/tokens"] == row["drift/tokens_stale0"] == sum(lens) == row["train/loss_tokens"]
        assert row["drift/gap_mean_abs"] < 1e-5 and row["drift/gap_p99_abs"] < 1e-4, row
        assert 0 <= row["drift/k3_kl"] < 1e-8
    assert sum(r["reward/errors"] for r in rows) > 0  # max_new_tokens=12: a multiple of 4
    assert rows[0]["train/loss"] != tiny.reference[0]["train/loss"]  # not boba's rewards


def test_a_server_serving_other_weights_than_pushed_fires_the_drift_alarm_at_the_first_step(tiny, tmp_path):
    """--perturb-weights: every weight the server loads is silently off by 5% (a bad load,
    as real engines' bugs do). The first step's gap is over the threshold: the run ends
    before training on those samples, naming the step, the server and the gap."""
    with embedded_servers(tiny.assets["model"], str(tmp_path / "logs"), n=1,
                          extra_args=["--perturb-weights", "0.05"]) as (bad,):
        overrides = [*_overrides(tiny.assets, bad.address, tmp_path), "trainer.max_rollout_logprob_gap=1e-3"]
        with pytest.raises(AssertionError, match=rf"RolloutDriftError: step 1: the rollout servers "
                                                 rf"\['{bad.address}'\] sampled \d+ tokens with weight version 0 "
                                                 r"whose logprobs are a mean \|Δ\| [0-9.e-]+ from the trainer's") as e:
            run_gloo(_ppo_worker, 1, overrides)
    print(str(e.value)[-800:])
    assert "trainer.max_rollout_logprob_gap=0.001" in str(e.value)
    assert not (tmp_path / "resume" / "stats.jsonl").exists()  # the step was not trained
    assert not (tmp_path / "resume" / "checkpoints" / "latest").exists()  # no step had finished


def test_a_taken_base_port_is_refused_in_one_line_naming_its_holder_before_anything_starts(tiny, tmp_path, capsys):
    """Another job's server on server.base_port: our server died of EADDRINUSE while the
    other answered /health, joined our weight-update group and got our weights. Now the
    train CLI refuses the port before any rank starts, naming it and its holder."""
    from areal_mcore.cli import main

    port = int(tiny.server.address.rsplit(":", 1)[1])
    overrides = [o for o in _overrides(tiny.assets, "x", tmp_path) if not o.startswith("server.addresses")]
    (tmp_path / "empty.yaml").write_text("{}\n")
    assert main(["train", "--config", str(tmp_path / "empty.yaml"), *overrides, f"server.base_port={port}"]) == 2
    err = capsys.readouterr().err.strip()
    print(err)
    assert len(err.splitlines()) == 1 and f"server.base_port={port}" in err
    assert f"port {port} is taken by pid {tiny.server.proc.pid} " in err
    assert not (tmp_path / "resume").exists()


def test_a_launched_server_whose_port_another_process_answers_on_is_never_taken_for_ours(tiny, tmp_path,
                                                                                          monkeypatch):
    """The race the check cannot close (the port taken between the check and the bind):
    the other server answers /health, but it is not our process, so the launch fails
    naming it instead of handing the run to it."""
    from areal_mcore.checks import FieldError
    from areal_mcore.rollout import servers
    from areal_mcore.rollout.config import ServerConfig

    monkeypatch.setattr(servers, "check_ports_free", lambda cfg: None)
    port = int(tiny.server.address.rsplit(":", 1)[1])
    cfg = ServerConfig(model_path=tiny.assets["model"], base_port=port, dtype="float32", context_length=256,
                       log_dir=str(tmp_path), startup_timeout_s=120)
    with pytest.raises(FieldError, match=rf"server.base_port={port} cannot be used: port {port} is taken by "
                                         rf"pid {tiny.server.proc.pid} "):
        servers.launch_servers(cfg, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_a_server_killed_mid_push_is_dropped_and_the_run_goes_on_with_the_survivor(tiny, tmp_path):
    """kill -9 of one of two servers while the weight push is under way (it SIGKILLs
    itself when step 2's update reaches it): the push failed with WeightSyncError, a
    traceback, exit 1 and no checkpoint. Now the push is done again to the survivor and
    the run goes on, its steps the uninterrupted run's."""
    with contextlib.ExitStack() as stack:
        victim = stack.enter_context(embedded_servers(tiny.assets["model"], str(tmp_path / "v"), n=1,
                                                      extra_args=["--die-at-update", "3"]))[0]
        survivor = stack.enter_context(embedded_servers(tiny.assets["model"], str(tmp_path / "s"), n=1))[0]
        overrides = [*_overrides(tiny.assets, f"{victim.address},{survivor.address}", tmp_path),
                     "trainer.save_freq=0"]
        (rows,) = run_gloo(_ppo_worker, 1, overrides)
        assert victim.proc.wait(10) == -signal.SIGKILL
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert rows[0]["sync/server_versions"] == ["1", "1"]
    assert rows[1]["sync/server_versions"] == ["2"]  # the survivor got step 2's weights after all
    same_steps(rows, tiny.reference)


@pytest.mark.parametrize("route", ["/generate:12", "/pause_generation:2"])
def test_the_only_server_stopped_mid_rollout_or_mid_sync_ends_the_run_with_a_checkpoint(tiny, tmp_path, route):
    """SIGSTOP of the run's only server (a hung engine: it accepts connections, answers
    nothing) as step 2's rollout sends it requests, or as step 1's weight sync pauses it.
    The pause waited for its 600 s timeout; every control call is now watched like a
    generate request. (Between steps: the test above.)"""
    with embedded_servers(tiny.assets["model"], str(tmp_path / "logs"), n=1,
                          extra_args=["--sigstop-at", route]) as (server,):
        overrides = [*_overrides(tiny.assets, server.address, tmp_path), "trainer.save_freq=0",
                     "rollout.stall_after_s=2", "rollout.stall_probe_s=3"]
        t = time.monotonic()
        try:
            with pytest.raises(AssertionError, match=rf"{server.address}") as e:
                run_gloo(_ppo_worker, 1, overrides)
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        took = time.monotonic() - t
    print(f"{route}: ended after {took:.1f} s: {str(e.value)[-300:]}")
    assert "RolloutError" in str(e.value) and took < 90
    # Stopped in step 2's rollout: step 1 is checkpointed; in step 1's sync: step 1 trained, and is.
    assert (tmp_path / "resume" / "checkpoints" / "latest").read_text().strip() == "step_00000001"


def _slow_forward_worker(rank, world, overrides, armed):
    """The PPO run with each forward-only micro-batch taking 1 s and each training 10 s
    once ``armed`` exists (a recompute of minutes, as at scale); ``armed.in`` is touched
    when a slow forward starts."""
    from areal_mcore.actor.megatron_actor import MegatronActor
    from areal_mcore.trainer.ppo import train

    run, train_batch = MegatronActor._run, MegatronActor.train_batch

    def slow_run(self, micro, loss_func, forward_only, model=None):
        if forward_only and os.path.exists(armed):
            open(armed + ".in", "w").close()
            time.sleep(1.0)
        return run(self, micro, loss_func, forward_only, model)

    def slow_train(self, *args, **kwargs):
        if os.path.exists(armed):  # a step that is not abandoned overruns any bound below
            time.sleep(30.0)
        return train_batch(self, *args, **kwargs)
    MegatronActor._run, MegatronActor.train_batch = slow_run, slow_train
    history = train(load_config(None, overrides))
    return list(history), history.stopped


def test_sigterm_during_the_recompute_abandons_the_step_within_a_micro_batch_and_the_run_resumes(tiny, tmp_path):
    """SIGTERM in the proximal recompute went on through it and the step's training
    before the checkpoint (30.5 s past a 30 s KillWait at the tiny run's scale). Now the
    forward stops at its next micro-batch, the step is abandoned and the last finished
    one checkpointed; the run says it stopped (EXIT_STOPPED's STOPPED file), and the
    resumed run's steps are the uninterrupted run's."""
    stats, armed = tmp_path / "resume" / "stats.jsonl", str(tmp_path / "armed")
    overrides = [*_overrides(tiny.assets, tiny.server.address, tmp_path), "trainer.save_freq=0",
                 "actor.mb_spec.max_tokens_per_mb=64"]  # several micro-batches
    ctx, port = rank_context(), free_port()
    queue = ctx.Queue()
    proc = ctx.Process(target=_worker, args=(0, 1, port, _slow_forward_worker, (overrides, armed), queue,
                                             _tiers.marks(), dict(os.environ)))
    proc.start()
    deadline = time.time() + 300
    while not (stats.exists() and len(stats.read_text().splitlines()) >= 1):
        assert time.time() < deadline and proc.exitcode is None
        time.sleep(0.05)
    open(armed, "w").close()
    while not os.path.exists(armed + ".in"):  # in step 2's recompute
        assert time.time() < deadline and proc.exitcode is None
        time.sleep(0.02)
    signalled = time.monotonic()
    os.kill(proc.pid, signal.SIGTERM)
    _, result, error = queue.get(timeout=120)
    returned = time.monotonic() - signalled
    proc.join(30)
    took = time.monotonic() - signalled
    assert error is None, error
    import pickle

    rows, stopped = pickle.loads(result)
    print(f"SIGTERM mid-recompute: checkpointed after {returned:.1f} s, exited after {took:.1f} s")
    # A 1 s micro-batch, the checkpoint and the exit: 5-6 s alone, 10 s on a loaded CI
    # machine; a step that went on to train would take 30 s more.
    assert stopped and took < 25, took
    assert (tmp_path / "resume" / "checkpoints" / "latest").read_text().strip() == "step_00000001"
    assert (tmp_path / "resume" / "STOPPED").read_text().strip() == "1"
    os.unlink(armed)
    (rows,) = run_gloo(_ppo_worker, 1, overrides)
    assert [r["step"] for r in rows] == [2, 3, 4] and not (tmp_path / "resume" / "STOPPED").exists()
    assert [r["step"] for r in _rows(stats)] == [1, 2, 3, 4]


def test_a_run_starts_from_a_converted_tp2_checkpoint_and_exports_with_its_tokenizer(tiny, tmp_path):
    """docs/checkpoints.md's flow: ``convert hf-to-mcore`` at TP=2 with the run's
    vocabulary padding -> 3 PPO steps at TP=2 -> ``mcore-to-hf`` with no flags. The
    converter had no padding flag (it padded to 128: the run failed on the embedding's
    shape); with the padding matched, the run failed on the trainer state a converted
    checkpoint does not hold (KeyError 'sampler'); the export had no tokenizer."""
    import subprocess
    import sys

    import torch
    from transformers import AutoTokenizer

    from areal_mcore.convert.tools import load_hf_state_dict, mcore_to_hf

    model, root = tiny.assets["model"], tmp_path / "resume" / "checkpoints"
    subprocess.run([sys.executable, "-W", "ignore", "-m", "areal_mcore.cli", "convert", "hf-to-mcore",
                    "--input", model, "--output", str(root), "--tp", "2", "--vocab-divisible-by", "8"],
                   check=True, capture_output=True, timeout=300)
    overrides = [*_overrides(tiny.assets, tiny.server.address, tmp_path), "trainer.total_steps=3",
                 "trainer.save_freq=3", "actor.parallel.tp=2"]
    rows = run_gloo(_ppo_worker_printing_to, 2, overrides, str(tmp_path / "console"))[0]
    assert [r["step"] for r in rows] == [1, 2, 3]
    said = "holds no trainer state, so the prompt order, rollout state, learning-rate schedule and W&B run"
    assert said in (tmp_path / "console.0").read_text()
    # The converted weights are the HF model's: step 1 samples as the TP=1 run from the HF
    # folder did, and its first minibatch's gradient has that run's norm (TP=2 sums in
    # another order; after an Adam step, whose first update is about lr x sign(grad) for
    # every weight, the runs part by more than rounding).
    ref = tiny.reference[0]
    for key in ("rollout/reward_mean", "rollout/response_len_mean"):
        assert rows[0][key] == ref[key], key
    assert rows[0]["train/grad_norm"][0] == pytest.approx(ref["train/grad_norm"][0], rel=1e-5)
    # The export of the run's checkpoint, with no flags, carries the run's tokenizer and the
    # weights the run's own end-of-run export holds.
    mcore_to_hf(root, tmp_path / "hf", progress=False, require_tokenizer=True)
    assert len(AutoTokenizer.from_pretrained(tmp_path / "hf")) == len(AutoTokenizer.from_pretrained(model)) > 1
    exported, own = load_hf_state_dict(tmp_path / "hf"), load_hf_state_dict(tmp_path / "resume" / "hf" / "step_3")
    assert set(exported) == set(own) and all(torch.equal(exported[k], own[k]) for k in own)
