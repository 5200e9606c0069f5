"""The in-allocation launcher: ``python -m areal_mcore.launcher.slurm run --config X.yaml [a.b=c ...]``.

Runs as the batch step of an sbatch job (launch/slurm/*.sh) or a submitit job. It splits
the job's nodes by ``launch.allocation`` (rollout nodes first), runs the doctor on every
node (``areal_mcore/doctor``: the job fails there, naming what to fix, before any server
starts; ``doctor.on_launch``), starts one ``srun`` step
per rollout server (each takes ``server.base_port + i`` or a free port on its node and publishes ``host:port`` to
``<run>/slurm/rendezvous/``), waits for their ``/health``, then starts the trainer as one
``srun`` step of torchrun across the trainer nodes, pointed at the servers.

Any step ending early ends the job with a non-zero code and a line naming the step.
Time limit: ``launch.stop_lead_s`` before the job's EndTime (re-read every 15 s: an admin
may move it; or longer, when the slowest recent step needs it), or on SIGUSR2 (``--signal=B:USR2@300``), this process touches
``<run>/STOP``; the trainer checkpoints at the end of its step and exits, and the job
requeues itself (``scontrol requeue``) when the run is not finished. A trainer still
running ``launch.requeue_margin_s`` before the limit is stopped and the job requeued all
the same (from the last checkpoint): a job Slurm ends at its limit is TIMEOUT, which
``--requeue`` does not cover. A requeued (or node-failure
resubmitted) job resumes from the latest checkpoint; ``launch.max_restarts`` bounds how
often. ``<run>/slurm/status.json`` says where the run is.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from areal_mcore.launcher.allocation import parse_allocation
from areal_mcore.net import free_port, healthy, set_gloo_interface, set_nccl_env
from areal_mcore.run_dir import RunDir, Status


@dataclasses.dataclass
class SlurmJob:
    job_id: str
    nodes: list[str]  # host names, in allocation order
    restarts: int
    end_time: float | None = None  # this try's time limit (epoch seconds); None: unlimited

    @classmethod
    def from_env(cls) -> SlurmJob:
        if "SLURM_JOB_ID" not in os.environ:
            raise RuntimeError("not inside a Slurm allocation (no SLURM_JOB_ID): submit with sbatch "
                               "launch/slurm/<recipe>.sh or areal-mcore launch")
        job_id = os.environ["SLURM_JOB_ID"]
        nodes = _scontrol("show", "hostnames", os.environ["SLURM_JOB_NODELIST"]).split()
        return cls(job_id, nodes, int(os.environ.get("SLURM_RESTART_COUNT", "0")), job_state(job_id)[1])


END_TIME_POLL_S = 15.0  # one `scontrol show job` per poll: nothing at any job size


def job_state(job_id: str) -> tuple[str, float | None]:
    """The job's JobState and EndTime (epoch seconds, from scontrol's local time; None for
    an unlimited job). EndTime is the time limit only while the job is RUNNING: once it is
    cancelled (scancel, preemption) scontrol shows the moment that happened, which a
    launcher that went on polling took for a limit already past and requeued the cancelled
    job (Slurm 22.05 requeues a finished batch job), which then ran on, try after try."""
    fields = dict(kv.split("=", 1) for kv in _scontrol("show", "job", "-o", job_id).split() if "=" in kv)
    state = fields.get("JobState", "")
    if fields.get("TimeLimit") == "UNLIMITED":
        return state, None
    try:
        return state, datetime.datetime.fromisoformat(fields["EndTime"]).timestamp()
    except (KeyError, ValueError):  # "Unknown"
        return state, None


def _scontrol(*args: str) -> str:
    return subprocess.run(["scontrol", *args], check=True, capture_output=True, text=True).stdout


def node_address(node: str) -> str:
    """The node's NodeAddr (what other nodes connect to)."""
    fields = dict(kv.split("=", 1) for kv in _scontrol("show", "node", "-o", node).split() if "=" in kv)
    return fields.get("NodeAddr", node)


# The job's GPU request as sbatch exports it, which every srun step reads back as its own
# (srun's input environment variables, src/srun/opt.c): with #SBATCH --gpus-per-node=8 a
# one-server step asked for all 8 GPUs of its node and the next server's step waited.
# --gpus-per-task does not cancel it (only --gpus does, and only from Slurm 24.11), and
# --cpus-per-gpu / --mem-per-gpu would clash with the steps' --cpus-per-task / --mem.
JOB_GPU_REQUEST = ("SLURM_GPUS", "SLURM_GPUS_PER_NODE", "SLURM_GPUS_PER_TASK", "SLURM_GPUS_PER_SOCKET",
                   "SLURM_CPUS_PER_GPU", "SLURM_MEM_PER_GPU", "SLURM_TRES_PER_TASK")


def step_environment() -> dict[str, str]:
    """This process's environment without the job's GPU request: a step gets the GPUs its
    own flags ask for, and none without them."""
    return {k: v for k, v in os.environ.items() if k not in JOB_GPU_REQUEST}


class Launcher:
    """``requeue_self=False`` under submitit, which owns the time-limit signal and the
    requeue (through ``stop_for_requeue``)."""

    def __init__(self, config: str, overrides: list[str], *, requeue_self: bool = True):
        from areal_mcore.config import load_config

        self.config, self.overrides = config, overrides
        self.cfg = cfg = load_config(config, overrides)
        self.alloc = parse_allocation(cfg.launch.allocation)
        self.job = SlurmJob.from_env()
        # SFT configs have no trainer section: their run folder is the default one.
        self.files = RunDir.of(cfg.trainer.log_dir if cfg.trainer else "runs", cfg.experiment_name)
        self.run_dir, self.slurm_dir = self.files.path, self.files.slurm
        self.logs = self.slurm_dir / f"job{self.job.job_id}_try{self.job.restarts}"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.status = Status(self.files, job_id=self.job.job_id)
        self.steps: dict[str, subprocess.Popen] = {}
        self.terminating, self.requeue_self, self.stop_asked = False, requeue_self, False
        self.api_key: str | None = None  # the rollout servers' (_start_servers)
        self.end_time_read = time.monotonic()  # SlurmJob.from_env read it
        os.environ.update({k: str(v) for k, v in cfg.launch.env.items()})  # srun steps inherit it
        set_nccl_env(os.environ)  # and the weight-update group's NCCL settings, unless set
        gpus = cfg.launch.gpus
        self.gpus = (self.alloc.rollout is None or self.alloc.rollout.backend != "embedded") if gpus is None else gpus

    # ---- the job -------------------------------------------------------------------------
    def run(self) -> int:
        job, launch = self.job, self.cfg.launch
        n_rollout, _ = self.alloc.place(len(job.nodes), launch.gpus_per_node)
        rollout_nodes, trainer_nodes = job.nodes[:n_rollout], job.nodes[n_rollout:]
        self.status.update(state="STARTING", restarts=job.restarts, step=self._step(),
                           last_checkpoint=self._checkpoint(), allocation=str(self.alloc),
                           rollout_nodes=rollout_nodes, trainer_nodes=trainer_nodes, logs=str(self.logs))
        if job.restarts > launch.max_restarts:
            return self._fail(f"restarted {job.restarts} times, over launch.max_restarts={launch.max_restarts}")
        self.files.clear_stop()  # a request to an earlier try
        self.files.clear_stopped()  # and how it ended
        if self.requeue_self:
            signal.signal(signal.SIGUSR2, self._on_usr2)
            if _EARLY_USR2:  # arrived while this process was still importing
                self._on_usr2(signal.SIGUSR2, None)
        signal.signal(signal.SIGTERM, self._on_term)
        try:
            if self.cfg.doctor.on_launch != "skip":  # before any server: a sick node fails the job in a minute
                self.status.update(state="DOCTOR")
                code, first = self.doctor()
                if code:
                    return self._fail(f"the doctor failed ({first}; all of it in {self.files.path / 'doctor.json'}); "
                                      "fix it, or resubmit with doctor.on_launch=warn to start anyway")
            addresses = self._start_servers(rollout_nodes) if self.alloc.rollout else []
            self._start_trainer(trainer_nodes, addresses)
            return self._watch()
        except Exception as e:  # noqa: BLE001 - every failure ends the job with a reason
            return self._fail(str(e))
        finally:
            self._stop_all()

    def doctor(self, *, warn_only: bool = False) -> tuple[int, str | None]:
        """``areal-mcore doctor`` on every node of this allocation: the exit code and the first
        failed check's line."""
        from areal_mcore.doctor.preflight import in_allocation, report

        start = time.monotonic()
        checks = in_allocation(self, {n: node_address(n) for n in self.job.nodes}, step_environment())
        warn_only = warn_only or self.cfg.doctor.on_launch == "warn"
        code = report(self.files, checks, warn_only=warn_only, job=self.job.job_id, attempt=self.job.restarts,
                      nodes=self.job.nodes, seconds=round(time.monotonic() - start, 1))
        return code, next((c.line for c in checks if c.state == "fail"), None)

    def server_nodes(self, nodes: list[str]) -> list[str]:
        """The node of each rollout server, in server order, on the rollout ``nodes``."""
        r, gpn = self.alloc.rollout, self.cfg.launch.gpus_per_node
        per_node = gpn // (r.t * r.p) if r.gpus >= gpn else r.d  # servers per node
        return [nodes[i // per_node] for i in range(r.d)]

    def _start_servers(self, nodes: list[str]) -> list[str]:
        r = self.alloc.rollout
        rendezvous = self.slurm_dir / "rendezvous"
        rendezvous.mkdir(exist_ok=True)
        for old in rendezvous.glob("server_*.json"):
            old.unlink()  # a previous try's ports
        from areal_mcore.rollout.auth import KEY_ENV, launch_key

        # The servers' key (configured, else new for this try, kept in <run>/rollout_api_key)
        # reaches the server steps and the trainer step in their environment, never on a
        # command line (srun's, or the servers': `serve`). SLURM_UMASK: the steps' output
        # files are created owner-only (srun(1)), as SGLang logs its args, the key among them.
        self.api_key = launch_key(self.cfg.server, self.files)
        env = {**step_environment(), KEY_ENV: self.api_key, "SLURM_UMASK": "0077"}
        for i, node in enumerate(self.server_nodes(nodes)):
            srun = self._srun(f"rollout{i}", [node], ntasks_per_node=1,
                              gpus_per_node=r.t if self.gpus else 0, share=r.t)
            cmd = [*srun, sys.executable, "-m", "areal_mcore.launcher.slurm", "serve", "--config", self.config,
                   "--index", str(i), "--host", node_address(node), "--rendezvous", str(rendezvous),
                   *self.overrides, f"server.tp_size={r.t}"]
            self.steps[f"rollout server {i} on {node}"] = subprocess.Popen(cmd, env=env)
        deadline = time.monotonic() + self.cfg.launch.server_startup_timeout_s
        addresses = []
        for i in range(r.d):
            path = rendezvous / f"server_{i}.json"
            while not path.exists() or not healthy(json.loads(path.read_text())["address"]):
                self._check_steps()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rollout server {i} not healthy after "
                                       f"{self.cfg.launch.server_startup_timeout_s:.0f} s (log {self.logs})")
                time.sleep(0.5)
            addresses.append(json.loads(path.read_text())["address"])
        self.status.update(state="SERVERS_UP", servers=addresses)
        return addresses

    def _start_trainer(self, nodes: list[str], addresses: list[str]) -> None:
        t, gpn = self.alloc.trainer, self.cfg.launch.gpus_per_node
        per_node = min(t.gpus, gpn)
        srun = self._srun("trainer", nodes, ntasks_per_node=1, gpus_per_node=per_node if self.gpus else 0,
                          share=per_node)
        # Node ranks and the master port come from the trainer's own nodes (trainer_node).
        port_file = self.slurm_dir / "rendezvous" / "trainer_master.json"
        port_file.parent.mkdir(exist_ok=True)
        port_file.unlink(missing_ok=True)  # a previous try's
        torchrun = [sys.executable, "-m", "areal_mcore.launcher.slurm", "torchrun",
                    "--nodes", ",".join(nodes), "--master-addr", node_address(nodes[0]),
                    "--port-file", str(port_file), "--",
                    f"--nnodes={len(nodes)}", f"--nproc-per-node={per_node}"]
        train = ["-m", "areal_mcore.cli", "train" if addresses else "sft", "--config", self.config,
                 *self.overrides, f"actor.parallel.tp={t.t}", f"actor.parallel.pp={t.p}"]
        if addresses and self.job.restarts:  # a requeued try goes on from its own earlier tries
            train.append("trainer.existing_run=resume")
        if addresses:
            train.append("server.addresses=[" + ",".join(f'"{a}"' for a in addresses) + "]")
        from areal_mcore.rollout.auth import KEY_ENV

        env = step_environment()
        if addresses and self.api_key:  # the trainer calls servers it did not start (server.addresses)
            env[KEY_ENV] = self.api_key
        self.steps["trainer"] = subprocess.Popen([*srun, *torchrun, *train], env=env)
        # This job's .out gets the launcher's lines only; the steps' progress is there.
        print(f"[launcher] trainer log (step progress): {self.logs / 'trainer.log'}; follow it with "
              f"tail -f {self.logs / 'trainer.log'}", flush=True)
        self.status.update(state="RUNNING")

    def _srun(self, name: str, nodes: list[str], *, ntasks_per_node: int, share: int,
              gpus_per_node: int = 0) -> list[str]:
        """An srun step of ``ntasks_per_node`` tasks per node, each using ``share`` of the
        node's GPUs (or processes): it gets that share of the node's CPUs and memory, and
        exactly ``gpus_per_node`` GPUs per node (run it with ``step_environment()``)."""
        # --ntasks too: srun would otherwise take the job's SLURM_NTASKS from the environment.
        cmd = ["srun", f"--job-name={name}", f"--nodes={len(nodes)}", f"--nodelist={','.join(nodes)}",
               f"--ntasks={len(nodes) * ntasks_per_node}", f"--ntasks-per-node={ntasks_per_node}",
               f"--output={self.logs / name}.log",
               "--kill-on-bad-exit=1"]
        if gpus_per_node:
            cmd.append(f"--gpus-per-node={gpus_per_node}")
        cmd += self.cfg.launch.step_resources(share, os.environ)
        print(f"[launcher] step {name}: {' '.join(cmd)}", flush=True)  # what admins check first
        return cmd + list(self.cfg.launch.srun_args)

    def _watch(self) -> int:
        trainer = self.steps["trainer"]
        while trainer.poll() is None:
            self._check_steps()
            self.status.update(step=self._step(), last_checkpoint=self._checkpoint())
            if self._time_limit_reached():
                print(f"[launcher] the trainer is still running {self._time_left():.0f} s before the "
                      f"time limit: stopping it; the next try resumes from {self._checkpoint()}", flush=True)
                return self._requeue()
            time.sleep(1.0)
        self.status.update(step=self._step(), last_checkpoint=self._checkpoint())
        if self.terminating:  # scancel or preemption: whatever the trainer's exit code
            self.status.update(state="TERMINATED")
            return 143
        # A trainer that stopped early with a checkpoint exits EXIT_STOPPED (75), which
        # torchrun reports as 1 like any failed worker: the run's STOPPED file tells them apart.
        if trainer.returncode != 0 and not self.files.was_stopped():
            return self._fail(f"trainer exited with code {trainer.returncode} (log {self.logs / 'trainer.log'})")
        # PPO stops early (with a checkpoint) only when asked to; SFT runs to its end (and
        # logs no PPO steps: a config with a trainer section, as tiny_cpu.yaml, requeued).
        ppo = self.alloc.rollout is not None
        step, total = self.files.checkpoint_step(), self.cfg.trainer.total_steps if ppo else 0
        if self._step() < total and not self.requeue_self:
            self.status.update(state="STOPPED")  # <run>/STOP by hand; submitting again goes on
            return 0
        if self._step() < total:  # stopped early for the time limit: go on in a new try
            print(f"[launcher] step {self._step()}/{total}, checkpoint at step {step}", flush=True)
            return self._requeue()
        self.status.update(state="COMPLETED")
        return 0

    def _requeue(self) -> int:
        self._stop_all()
        try:
            state = job_state(self.job.job_id)[0]
        except subprocess.CalledProcessError:  # slurmctld busy: requeue, which retries it
            state = "RUNNING"
        if state != "RUNNING":
            # Cancelled or preempted while stopping: `scontrol requeue` would bring even a
            # CANCELLED batch job back (Slurm requeues finished jobs), and it would run on.
            print(f"[launcher] job {self.job.job_id} is {state}: not requeueing it", flush=True)
            self.status.update(state="TERMINATED", step=self._step(), last_checkpoint=self._checkpoint())
            return 143
        self.status.update(state="REQUEUED", restarts=self.job.restarts + 1, step=self._step(),
                           last_checkpoint=self._checkpoint())
        print(f"[launcher] requeueing job {self.job.job_id}", flush=True)
        subprocess.run(["scontrol", "requeue", self.job.job_id], check=True)
        return 0

    def _time_left(self) -> float:
        # The limit can move while the job runs (an admin's `scontrol update JobId=..
        # TimeLimit=..`): re-read it every END_TIME_POLL_S instead of trusting the start's.
        now = time.monotonic()
        if now - self.end_time_read >= END_TIME_POLL_S:
            self.end_time_read = now
            try:
                state, end_time = job_state(self.job.job_id)
            except subprocess.CalledProcessError:  # slurmctld busy: keep the last limit read
                state, end_time = "RUNNING", self.job.end_time
            if state == "RUNNING":
                self.job.end_time = end_time
            else:  # scancel or preemption: its EndTime is that moment, not a limit to requeue at
                self.terminating = True
        return self.job.end_time - time.time() if self.job.end_time else float("inf")

    def _time_limit_reached(self) -> bool:
        """Asks the trainer to stop ``_stop_lead_s()`` before the time limit; True once the
        trainer must be stopped for the job to requeue before Slurm ends it as TIMEOUT
        (sbatch jobs only: under submitit, submitit owns the time limit)."""
        left, launch = self._time_left(), self.cfg.launch
        if not self.requeue_self or self.terminating or left == float("inf"):
            return False
        if left < self._stop_lead_s() and not self.stop_asked:
            self.stop_asked = True
            print(f"[launcher] time limit in {left:.0f} s: asking the trainer to checkpoint and stop",
                  flush=True)
            self.files.request_stop()
        return left < launch.requeue_margin_s

    def _stop_lead_s(self) -> float:
        """``launch.stop_lead_s``, or more when the slowest of the last steps (its time
        includes the previous step's checkpoint save) would not fit in it."""
        slowest = max((r.get("time/step_s", 0.0) for r in self.files.stats_tail(5)), default=0.0)
        launch = self.cfg.launch
        return max(launch.stop_lead_s, 1.5 * slowest + launch.requeue_margin_s)

    def _check_steps(self) -> None:
        for name, proc in self.steps.items():
            if name != "trainer" and proc.poll() is not None and not self.terminating:
                raise RuntimeError(f"{name} exited with code {proc.returncode} (logs in {self.logs})")

    def _fail(self, why: str) -> int:
        print(f"[launcher] job {self.job.job_id} failed: {why}", file=sys.stderr, flush=True)
        self.status.update(state="FAILED", error=why)
        return 1

    def _stop_all(self) -> None:
        live = [p for p in self.steps.values() if p.poll() is None]
        for p in live:
            p.send_signal(signal.SIGTERM)  # srun passes it to its tasks
        deadline = time.monotonic() + 30
        for p in live:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def stop_for_requeue(self, grace_s: float = 240.0) -> None:
        """The trainer checkpoints and exits, then every step stops; the caller requeues."""
        self.files.request_stop()
        trainer = self.steps.get("trainer")
        if trainer is not None:
            try:
                trainer.wait(grace_s)
            except subprocess.TimeoutExpired:
                print(f"[launcher] trainer still running after {grace_s:.0f} s: the next try resumes "
                      f"from {self._checkpoint()}", flush=True)
        self._stop_all()
        self.status.update(state="REQUEUED", restarts=self.job.restarts + 1, step=self._step(),
                           last_checkpoint=self._checkpoint())

    def _on_usr2(self, signum, frame) -> None:
        print("[launcher] time limit near (SIGUSR2): asking the trainer to checkpoint and stop", flush=True)
        self.files.request_stop()

    def _on_term(self, signum, frame) -> None:
        # scancel or preemption: Slurm signals the steps itself; the trainer checkpoints if
        # it can before the KillWait grace runs out.
        self.terminating = True
        self.files.request_stop()

    # ---- where the run is ---------------------------------------------------------------
    def _step(self) -> int:
        return self.files.last_step()

    def _checkpoint(self) -> str | None:
        path = self.files.latest_checkpoint()
        return str(path) if path else None


def serve(config: str, overrides: list[str], index: int, host: str, rendezvous: Path) -> None:
    """One rollout server (an srun task): takes its port (server.base_port + index, else a free
    one on this node), publishes it, execs."""
    from areal_mcore.config import load_config
    from areal_mcore.rollout.auth import configured_key
    from areal_mcore.rollout.engines import engine_for
    from areal_mcore.rollout.servers import server_command

    cfg = load_config(config, overrides)
    port = cfg.server.base_port + index if cfg.server.base_port else free_port(host)
    server = dataclasses.replace(cfg.server, host=host)
    cmd = server_command(server, port=port, seed=cfg.server.seed + index)
    # As launch_servers does: the engine's environment, and the key (the launcher's, in
    # ours: Launcher._start_servers) by the engine's own means, never on the command line;
    # disk loads from under the run directory only. A folder per server for a key file:
    # the steps on several nodes share the run directory.
    engine = engine_for(server.backend)
    run = RunDir.of(cfg.trainer.log_dir, cfg.experiment_name)
    args, env = engine.auth(server, engine.env(server, dict(os.environ)), api_key=configured_key(server),
                            weights_root=str(run.path.absolute()), private_dir=str(rendezvous / f"server_{index}"))
    tmp = rendezvous / f".server_{index}.json"
    tmp.write_text(json.dumps({"index": index, "address": f"{host}:{port}", "node": os.uname().nodename}))
    tmp.replace(rendezvous / f"server_{index}.json")
    os.execve(cmd[0], cmd + args, env)


def trainer_node(nodes: list[str], me: str, port_file: Path, timeout_s: float = 600.0) -> tuple[int, int]:
    """(node rank, master port) of this trainer node (an srun task of the trainer step).

    The rank is this node's place in ``nodes``, whose first node hosts torchrun's store at
    ``--master-addr``, not ``SLURM_PROCID``: Slurm numbers a step's tasks in its node-table
    order (slurm.conf), which need not be name order, and rank 0 then hosted the store on
    another machine than the master address (each side waited for the other). The port is
    picked on the master node itself, not on the batch node, and published on the shared
    run folder as the servers' ports are."""
    if me not in nodes:
        raise RuntimeError(f"trainer node {me!r} (SLURMD_NODENAME) is not one of the trainer nodes {nodes}")
    rank = nodes.index(me)
    if rank == 0:
        port = free_port("0.0.0.0")  # torchrun's store listens on every interface
        tmp = port_file.with_name(f".{port_file.name}")
        tmp.write_text(json.dumps({"node": me, "port": port}))
        tmp.replace(port_file)
        return 0, port
    deadline = time.monotonic() + timeout_s
    while not port_file.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no master port from {nodes[0]} in {port_file} after {timeout_s:.0f} s")
        time.sleep(0.2)
    return rank, json.loads(port_file.read_text())["port"]


_EARLY_USR2: list[int] = []


def _refused_before_start(config: str, overrides: list[str]) -> bool:
    """The plan's refusal, or the actor's of the model's config.json, before any step starts."""
    from areal_mcore.config import load_config
    from areal_mcore.model.args import check_model_folder
    from areal_mcore.plan import refusal

    cfg = load_config(config, overrides)
    why = refusal(cfg)
    try:
        if cfg.launch.stage == "sft" and cfg.sft is not None:
            check_model_folder("sft.base_model", cfg.sft.base_model, cfg.actor.parallel.ep)
        elif cfg.model_path:
            check_model_folder("model_path", cfg.model_path, cfg.actor.parallel.ep, cfg.actor.router_replay)
    except ValueError as e:
        why = str(e)
    if why:
        print(f"[launcher] {why}", file=sys.stderr)
    return why is not None


def main(argv: list[str] | None = None) -> int:
    # First thing: Slurm's time-limit signal can come before the launcher is ready, and
    # SIGUSR2's default action would end the job.
    signal.signal(signal.SIGUSR2, lambda signum, frame: _EARLY_USR2.append(signum))
    p = argparse.ArgumentParser(prog="python -m areal_mcore.launcher.slurm", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a config inside this Slurm allocation")
    serve_p = sub.add_parser("serve", help="(internal) one rollout server step")
    torchrun = sub.add_parser("torchrun", help="(internal) one trainer node: torchrun with its node rank")
    torchrun.add_argument("--nodes", required=True)
    torchrun.add_argument("--master-addr", required=True)
    torchrun.add_argument("--port-file", type=Path, required=True)
    torchrun.add_argument("args", nargs=argparse.REMAINDER)
    doctor = sub.add_parser("doctor-node", help="(internal) one node's doctor checks")
    doctor.add_argument("--dir", type=Path, required=True)
    for q in (run, serve_p, doctor):
        q.add_argument("--config", required=True)
        q.add_argument("overrides", nargs="*")
    serve_p.add_argument("--index", type=int, required=True)
    serve_p.add_argument("--host", required=True)
    serve_p.add_argument("--rendezvous", type=Path, required=True)
    run.add_argument("--no-plan-check", action="store_true",
                     help="start even when the memory planner says the config does not fit")
    a = p.parse_args(argv)
    if a.command == "torchrun":
        rank, port = trainer_node(a.nodes.split(","), os.environ["SLURMD_NODENAME"], a.port_file)
        set_gloo_interface(os.environ, a.master_addr)
        args = a.args[1:] if a.args[:1] == ["--"] else a.args
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--node-rank={rank}",
               f"--master-addr={a.master_addr}", f"--master-port={port}", *args]
        os.execv(cmd[0], cmd)
        return 0  # not reached: execv replaces this process
    if a.command == "doctor-node":
        from areal_mcore.config import load_config
        from areal_mcore.doctor.preflight import node_step

        return node_step(load_config(a.config, a.overrides), a.dir)
    if a.command == "serve":
        serve(a.config, a.overrides, a.index, a.host, a.rendezvous)
        return 0
    try:
        # plan.check=false travels with the overrides to the trainer step, which checks too.
        overrides = a.overrides + (["plan.check=false"] if a.no_plan_check else [])
        if _refused_before_start(a.config, overrides):  # before any server is started
            return 2
        launcher = Launcher(a.config, overrides)
    except (ValueError, RuntimeError, FileNotFoundError) as e:
        print(f"[launcher] error: {e}", file=sys.stderr)
        return 2
    return launcher.run()


if __name__ == "__main__":
    sys.exit(main())
