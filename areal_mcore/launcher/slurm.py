"""The in-allocation launcher: ``python -m areal_mcore.launcher.slurm run --config X.yaml [a.b=c ...]``.

Runs as the batch step of an sbatch job (launch/slurm/*.sh) or a submitit job. It splits
the job's nodes by ``launch.allocation`` (rollout nodes first), starts one ``srun`` step
per rollout server (each picks a free port on its node and publishes ``host:port`` to
``<run>/slurm/rendezvous/``), waits for their ``/health``, then starts the trainer as one
``srun`` step of torchrun across the trainer nodes, pointed at the servers.

Any step ending early ends the job with a non-zero code and a line naming the step.
Time limit: SIGUSR2 (``--signal=B:USR2@300``) makes this process touch ``<run>/STOP``; the
trainer checkpoints at the end of its step and exits, and the job requeues itself
(``scontrol requeue``) when the run is not finished. A requeued (or node-failure
resubmitted) job resumes from the latest checkpoint; ``launch.max_restarts`` bounds how
often. ``<run>/slurm/status.json`` says where the run is.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from areal_mcore.launcher.allocation import parse_allocation
from areal_mcore.net import free_port, healthy, set_nccl_env
from areal_mcore.run_dir import RunDir, Status


@dataclasses.dataclass
class SlurmJob:
    job_id: str
    nodes: list[str]  # host names, in allocation order
    restarts: int

    @classmethod
    def from_env(cls) -> SlurmJob:
        if "SLURM_JOB_ID" not in os.environ:
            raise RuntimeError("not inside a Slurm allocation (no SLURM_JOB_ID): submit with sbatch "
                               "launch/slurm/<recipe>.sh or areal-mcore launch")
        nodes = _scontrol("show", "hostnames", os.environ["SLURM_JOB_NODELIST"]).split()
        return cls(os.environ["SLURM_JOB_ID"], nodes, int(os.environ.get("SLURM_RESTART_COUNT", "0")))


def _scontrol(*args: str) -> str:
    return subprocess.run(["scontrol", *args], check=True, capture_output=True, text=True).stdout


def node_address(node: str) -> str:
    """The node's NodeAddr (what other nodes connect to)."""
    fields = dict(kv.split("=", 1) for kv in _scontrol("show", "node", "-o", node).split() if "=" in kv)
    return fields.get("NodeAddr", node)


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
        self.terminating, self.requeue_self = False, requeue_self
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
        if self.requeue_self:
            signal.signal(signal.SIGUSR2, self._on_usr2)
            if _EARLY_USR2:  # arrived while this process was still importing
                self._on_usr2(signal.SIGUSR2, None)
        signal.signal(signal.SIGTERM, self._on_term)
        try:
            addresses = self._start_servers(rollout_nodes) if self.alloc.rollout else []
            self._start_trainer(trainer_nodes, addresses)
            return self._watch()
        except Exception as e:  # noqa: BLE001 - every failure ends the job with a reason
            return self._fail(str(e))
        finally:
            self._stop_all()

    def _start_servers(self, nodes: list[str]) -> list[str]:
        r, gpn = self.alloc.rollout, self.cfg.launch.gpus_per_node
        per_node = gpn // (r.t * r.p) if r.gpus >= gpn else r.d  # servers per node
        rendezvous = self.slurm_dir / "rendezvous"
        rendezvous.mkdir(exist_ok=True)
        for old in rendezvous.glob("server_*.json"):
            old.unlink()  # a previous try's ports
        for i in range(r.d):
            node = nodes[i // per_node]
            srun = self._srun(f"rollout{i}", [node], ntasks_per_node=1,
                              gpus_per_task=r.t * r.p if self.gpus else 0, share=r.t * r.p)
            cmd = [*srun, sys.executable, "-m", "areal_mcore.launcher.slurm", "serve", "--config", self.config,
                   "--index", str(i), "--host", node_address(node), "--rendezvous", str(rendezvous),
                   *self.overrides, f"server.tp_size={r.t}"]
            self.steps[f"rollout server {i} on {node}"] = subprocess.Popen(cmd)
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
        master = node_address(nodes[0])
        srun = self._srun("trainer", nodes, ntasks_per_node=1, gpus_per_node=per_node if self.gpus else 0,
                          share=per_node)
        # Static rendezvous: node rank = the srun task's rank (one task per node). torchrun's
        # c10d rendezvous fails at exit when the node hosting its store leaves first.
        torchrun = ["bash", "-c", 'exec "$0" -m torch.distributed.run --node-rank="$SLURM_PROCID" "$@"',
                    sys.executable, f"--nnodes={len(nodes)}", f"--nproc-per-node={per_node}",
                    f"--master-addr={master}", f"--master-port={free_port()}"]
        train = ["-m", "areal_mcore.cli", "train" if addresses else "sft", "--config", self.config,
                 *self.overrides, f"actor.parallel.tp={t.t}", f"actor.parallel.pp={t.p}"]
        if addresses:
            train.append("server.addresses=[" + ",".join(f'"{a}"' for a in addresses) + "]")
        self.steps["trainer"] = subprocess.Popen([*srun, *torchrun, *train])
        self.status.update(state="RUNNING")

    def _srun(self, name: str, nodes: list[str], *, ntasks_per_node: int, share: int, gpus_per_task: int = 0,
              gpus_per_node: int = 0) -> list[str]:
        """An srun step of ``ntasks_per_node`` tasks per node, each using ``share`` of the
        node's GPUs (or processes): it gets that share of the node's CPUs and memory."""
        # --ntasks too: srun would otherwise take the job's SLURM_NTASKS from the environment.
        cmd = ["srun", f"--job-name={name}", f"--nodes={len(nodes)}", f"--nodelist={','.join(nodes)}",
               f"--ntasks={len(nodes) * ntasks_per_node}", f"--ntasks-per-node={ntasks_per_node}",
               f"--output={self.logs / name}.log",
               "--kill-on-bad-exit=1"]
        if gpus_per_task:
            cmd.append(f"--gpus-per-task={gpus_per_task}")
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
            time.sleep(1.0)
        self.status.update(step=self._step(), last_checkpoint=self._checkpoint())
        if trainer.returncode != 0:
            return self._fail(f"trainer exited with code {trainer.returncode} (log {self.logs / 'trainer.log'})")
        if self.terminating:
            self.status.update(state="TERMINATED")
            return 143
        # PPO stops early (with a checkpoint) only when asked to; SFT runs to its end.
        step, total = self.files.checkpoint_step(), self.cfg.trainer.total_steps if self.cfg.trainer else 0
        if self._step() < total and not self.requeue_self:
            self.status.update(state="STOPPED")  # <run>/STOP by hand; submitting again goes on
            return 0
        if self._step() < total:  # stopped early on the time-limit signal: go on in a new try
            self._stop_all()
            self.status.update(state="REQUEUED", restarts=self.job.restarts + 1)
            print(f"[launcher] step {self._step()}/{total}, checkpoint at step {step}: requeueing "
                  f"job {self.job.job_id}", flush=True)
            subprocess.run(["scontrol", "requeue", self.job.job_id], check=True)
            return 0
        self.status.update(state="COMPLETED")
        return 0

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
    """One rollout server (an srun task): picks a port on this node, publishes it, execs."""
    from areal_mcore.config import load_config
    from areal_mcore.rollout.launcher import server_command

    cfg = load_config(config, overrides)
    port = free_port(host)
    cmd = server_command(dataclasses.replace(cfg.server, host=host), port=port, seed=cfg.server.seed + index)
    tmp = rendezvous / f".server_{index}.json"
    tmp.write_text(json.dumps({"index": index, "address": f"{host}:{port}", "node": os.uname().nodename}))
    tmp.replace(rendezvous / f"server_{index}.json")
    os.execv(cmd[0], cmd)


_EARLY_USR2: list[int] = []


def _refused_by_plan(config: str, overrides: list[str]) -> bool:
    from areal_mcore.config import load_config
    from areal_mcore.plan import refusal

    why = refusal(load_config(config, overrides))
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
    for q in (run, serve_p):
        q.add_argument("--config", required=True)
        q.add_argument("overrides", nargs="*")
    serve_p.add_argument("--index", type=int, required=True)
    serve_p.add_argument("--host", required=True)
    serve_p.add_argument("--rendezvous", type=Path, required=True)
    run.add_argument("--no-plan-check", action="store_true",
                     help="start even when the memory planner says the config does not fit")
    a = p.parse_args(argv)
    if a.command == "serve":
        serve(a.config, a.overrides, a.index, a.host, a.rendezvous)
        return 0
    try:
        # plan.check=false travels with the overrides to the trainer step, which checks too.
        overrides = a.overrides + (["plan.check=false"] if a.no_plan_check else [])
        if _refused_by_plan(a.config, overrides):  # before any server is started
            return 2
        launcher = Launcher(a.config, overrides)
    except (ValueError, RuntimeError, FileNotFoundError) as e:
        print(f"[launcher] error: {e}", file=sys.stderr)
        return 2
    return launcher.run()


if __name__ == "__main__":
    sys.exit(main())
