"""Where the checks run: this machine (``local``), or every node of a Slurm allocation
(``in_allocation``, from the launcher's batch step: one srun task per node, ``node_step``,
then the fabric step started as the trainer's is)."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from areal_mcore.doctor.gpus import gpu_checks
from areal_mcore.doctor.node import (
    bind_ports,
    env_check,
    infiniband_check,
    interface_checks,
    reach_check,
    stack_checks,
    storage_checks,
)
from areal_mcore.doctor.slurm_checks import (
    checkpoint_seconds,
    job_fields,
    slurm_checks,
    slurm_config,
)
from areal_mcore.doctor.table import Check, exit_code, fail, format_table, write_json
from areal_mcore.run_dir import RunDir, write_atomic

KEEP_CHECKPOINTS = 2 + 1  # CheckpointConfig.keep_last, and the one being written before the oldest goes


@dataclasses.dataclass
class NodeRole:
    """What the run will start on one node."""

    node: str
    address: str
    gpus: int = 0  # GPUs its steps ask for
    servers: int = 0  # rollout servers on it
    ports: list[int] = dataclasses.field(default_factory=list)  # their planned ports (server.base_port + i)
    trainer: bool = False


def run_dir(cfg) -> RunDir:
    return RunDir.of(cfg.trainer.log_dir if cfg.trainer else "runs", cfg.experiment_name)


def _model_of(cfg):
    """``cfg`` with the model the run trains as ``model_path``: an SFT stage's is sft.base_model."""
    if cfg.launch.stage == "sft" and cfg.sft is not None:
        return dataclasses.replace(cfg, model_path=cfg.sft.base_model)
    return cfg


def disk_plan(cfg) -> tuple[int, int]:
    """(bytes of one checkpoint, bytes the run may hold at once: the kept checkpoints, the one
    being written, and the HF exports). A megatron checkpoint holds the weights, fp32 main
    params below fp32, and Adam's two fp32 moments; an export, the weights."""
    from areal_mcore.plan.architectures import resolve_architecture
    from areal_mcore.plan.memory import total_params

    params = total_params(resolve_architecture(_model_of(cfg).model_path, cfg.plan.architecture)[0])
    weight = 4 if cfg.actor.dtype == "float32" else 2
    checkpoint = params * (weight + (4 if weight < 4 else 0) + 8)
    t = cfg.trainer
    if t is None or cfg.launch.stage == "sft":  # SFT writes its model only
        return 0, params * weight
    exports = (t.total_steps // t.export_freq if t.export_freq else 0) + 1
    return checkpoint, (KEEP_CHECKPOINTS * checkpoint if t.save_freq else 0) + exports * params * weight


def node_checks(cfg, role: NodeRole, master: str, environ: Mapping[str, str], nvml=None
                ) -> tuple[list[Check], dict, list[socket.socket]]:
    """This node's checks; what the batch step needs from it (GPU memory, write speed); the
    sockets holding the planned server ports (for the reach check)."""
    wanted, where = set(cfg.doctor.checks), role.node
    checks, info, socks = [], {}, []
    if "gpu" in wanted:
        found, info["gpu_memory_gib"] = gpu_checks(role.gpus, where, nvml)
        checks += found
    if "stack" in wanted:
        from areal_mcore.rollout.servers import server_command

        python = server_command(cfg.server, port=0, seed=0)[0] if role.servers and cfg.server else None
        checks += stack_checks(python, cfg.server.backend if cfg.server else None, role.gpus, where)
    if "storage" in wanted:
        try:
            need = disk_plan(cfg)[1]
        except (ValueError, FileNotFoundError, OSError):  # no model yet: the memory check says so
            need = 0
        found, info["write_bps"] = storage_checks(run_dir(cfg).path, need, where)
        checks += found
    if "env" in wanted and role.servers:
        checks.append(env_check(environ, where))
    if "ports" in wanted and role.ports:
        found, socks = bind_ports(role.address, role.ports, where)
        checks += found
    if "network" in wanted and role.trainer:
        checks += interface_checks(master, environ, where)
    return checks, info, socks


def fabric_check(cmd: list[str], env: dict, out: Path, cfg, nodes: int, log: Path) -> Check:
    """Runs ``cmd`` (torchrun of areal_mcore.doctor.fabric, through srun in an allocation)."""
    for old in out.glob("fabric*"):
        old.unlink()
    timeout = cfg.doctor.timeout_s
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            _stop(proc)
            code = None
    result = out / "fabric.json"
    errors = sorted(out.glob("fabric_error_rank*.txt"))
    if result.exists() and code == 0:
        r = json.loads(result.read_text())
        floor = cfg.doctor.min_busbw_gbps
        if floor is None and r["backend"] == "nccl":
            floor = 100.0 if nodes == 1 else 10.0
        low = floor is not None and r["busbw_gbps"] < floor
        iface = r.get("nccl_interface") or r.get("gloo_interface") or "the route's"
        if r["world"] == 1:  # nothing crosses a link: no bandwidth to judge
            return Check("fabric.all_reduce", "pass", f"{r['backend']} group of 1 rank formed and reduced "
                         "(one trainer rank: no link to measure)")
        return Check("fabric.all_reduce", "warn" if low else "pass",
                     f"{r['backend']} busbw {r['busbw_gbps']:.2f} GB/s over {r['world']} ranks on {nodes} node(s) "
                     f"({r['mb']} MB, interface {iface})", f">= {floor:g} GB/s" if floor is not None else "",
                     "slower than this interconnect should be: check NCCL_IB_HCA / NCCL_SOCKET_IFNAME "
                     "(launch.env), and that NCCL does not fall back to TCP (NCCL_DEBUG=INFO)")
    if errors:
        first = errors[0].read_text().splitlines()[0]
        why = f"rank {errors[0].stem.removeprefix('fabric_error_rank')}: {first}"
    elif code is None:
        why = f"no result in {timeout:.0f} s: the ranks did not connect"
    else:
        tail = log.read_text().strip().splitlines()[-1:] if log.exists() else []
        why = f"exited with code {code}: {tail[0] if tail else ''}"
    return fail("fabric.all_reduce", why, "an all-reduce over every trainer rank",
                "check that GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME name an interface that reaches the first "
                f"trainer node, and no firewall blocks its ports (log {log})")


def _stop(proc: subprocess.Popen) -> None:
    """The whole session (srun, torchrun and its workers): a rank stuck in connect ignores nothing."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def memory_check(cfg, gpu_gib: float | None) -> Check:
    from areal_mcore.plan import make_plan

    try:
        plan = make_plan(_model_of(cfg), gpu_gib, with_fixes=False)
    except (ValueError, FileNotFoundError) as e:
        return fail("memory.plan", str(e), "a model the planner can read", "fix model_path (or set "
                    "plan.architecture)")
    gib, source = plan.gpu_bytes / 2**30, "the smallest GPU found" if gpu_gib else "plan.gpu_memory_gb; no GPU seen"
    peak = plan.peak.total / 2**30
    server = "" if plan.server is None else (", servers fit" if plan.server["fits"] else ", servers do not fit")
    return Check("memory.plan", "pass" if plan.fits else "fail", f"peak rank {peak:.1f} GiB of {gib:.1f} GiB "
                 f"({source}){server}", "fits", f"run `areal-mcore plan --gpu-memory-gb {gib:.1f}` with this "
                 "config for the fixes")


# ---- this machine -------------------------------------------------------------------------
def local(cfg, *, nvml=None, environ: Mapping[str, str] = os.environ) -> list[Check]:
    """The checks for a run on this machine (`areal-mcore train` under torchrun)."""
    import torch

    from areal_mcore.net import free_port
    from areal_mcore.procs import child_env

    wanted, s = set(cfg.doctor.checks), cfg.server
    servers = 0 if s is None or s.addresses or cfg.rollout is None else s.n_servers
    gpus = cfg.launch.gpus if cfg.launch.gpus is not None else (
        torch.cuda.is_available() or (s is not None and s.backend == "sglang"))
    ports = list(range(s.base_port, s.base_port + servers)) if servers and s.base_port else []
    role = NodeRole(socket.gethostname(), s.host if s else "127.0.0.1", gpus=int(gpus), servers=servers,
                    ports=ports, trainer=True)
    checks, info, socks = node_checks(cfg, role, "127.0.0.1", environ, nvml)
    for sock in socks:
        sock.close()
    out = run_dir(cfg).slurm / "doctor" / "local"
    if "fabric" in wanted:
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError:
            out = Path(os.environ.get("TMPDIR", "/tmp")) / f"areal-doctor-{os.getpid()}"
            out.mkdir(parents=True, exist_ok=True)
        ranks = torch.cuda.device_count() if torch.cuda.is_available() else 2
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc-per-node={ranks}",
               "--master-addr=127.0.0.1", f"--master-port={free_port()}", "-m", "areal_mcore.doctor.fabric",
               "--out", str(out), "--mb", str(cfg.doctor.allreduce_mb), "--timeout-s", str(cfg.doctor.timeout_s)]
        checks.append(fabric_check(cmd, child_env(environ), out, cfg, 1, out / "fabric.log"))
    if "slurm" in wanted:
        checks.append(Check("slurm", "skip", "not in a Slurm job (no SLURM_JOB_ID)"))
    if "memory" in wanted:
        checks.append(memory_check(cfg, info.get("gpu_memory_gib")))
    return checks


# ---- a Slurm allocation -------------------------------------------------------------------
def in_allocation(launcher, addresses: dict[str, str], env: dict[str, str]) -> list[Check]:
    """Every node's checks (one srun step), the fabric (an srun step of torchrun on the trainer
    nodes, as the trainer starts), then Slurm's settings and the plan, from the batch step.
    ``launcher``: the Slurm launcher of this job; ``addresses``: its nodes' NodeAddr; ``env``:
    the environment its steps get."""
    cfg, job, alloc = launcher.cfg, launcher.job, launcher.alloc
    wanted, gpn, s = set(cfg.doctor.checks), cfg.launch.gpus_per_node, cfg.server
    n_rollout, _ = alloc.place(len(job.nodes), gpn)
    rollout_nodes, trainer_nodes = job.nodes[:n_rollout], job.nodes[n_rollout:]
    roles = {n: NodeRole(n, addresses[n]) for n in job.nodes}
    if alloc.rollout:
        r = alloc.rollout
        for i, node in enumerate(launcher.server_nodes(rollout_nodes)):  # where Launcher._start_servers puts them
            role = roles[node]
            role.servers += 1
            role.gpus += r.t if launcher.gpus else 0
            if s.base_port:
                role.ports.append(s.base_port + i)
    for n in trainer_nodes:
        roles[n].trainer, roles[n].gpus = True, min(alloc.trainer.gpus, gpn) if launcher.gpus else 0
    master = roles[trainer_nodes[0]].address
    out = launcher.slurm_dir / "doctor" / f"job{job.job_id}_try{job.restarts}"
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*"):
        old.unlink()
    plan = {"master": master, "trainer_nodes": trainer_nodes, "nodes": {n: dataclasses.asdict(r) for n, r in roles.items()}}
    (out / "roles.json").write_text(json.dumps(plan))
    srun = launcher._srun("doctor", job.nodes, ntasks_per_node=1, share=gpn, gpus_per_node=gpn if launcher.gpus else 0)
    cmd = [*srun, sys.executable, "-m", "areal_mcore.launcher.slurm", "doctor-node", "--config", launcher.config,
           "--dir", str(out), *launcher.overrides]
    checks = _node_step(cmd, env, out, job.nodes, cfg.doctor.timeout_s)
    infos = [json.loads((out / f"node_{n}.json").read_text())["info"] for n in job.nodes
             if (out / f"node_{n}.json").exists()]
    if "fabric" in wanted:
        t = alloc.trainer
        per_node = min(t.gpus, gpn)
        fab = launcher._srun("doctor-fabric", trainer_nodes, ntasks_per_node=1, share=per_node,
                             gpus_per_node=per_node if launcher.gpus else 0)
        torchrun = [sys.executable, "-m", "areal_mcore.launcher.slurm", "torchrun", "--nodes", ",".join(trainer_nodes),
                    "--master-addr", master, "--port-file", str(out / "fabric_master.json"), "--",
                    f"--nnodes={len(trainer_nodes)}", f"--nproc-per-node={per_node}", "-m", "areal_mcore.doctor.fabric",
                    "--out", str(out), "--mb", str(cfg.doctor.allreduce_mb), "--timeout-s", str(cfg.doctor.timeout_s)]
        checks.append(fabric_check([*fab, *torchrun], env, out, cfg, len(trainer_nodes), out / "fabric.log"))
    if "slurm" in wanted:
        try:
            ckpt = disk_plan(cfg)[0]
        except (ValueError, FileNotFoundError, OSError):
            ckpt = 0
        speeds = [i["write_bps"] for i in infos if i.get("write_bps")]
        seconds, whence = checkpoint_seconds(launcher.files, ckpt, min(speeds, default=None))
        checks += slurm_checks(cfg, job_fields(job.job_id), slurm_config(), checkpoint_s=seconds,
                               checkpoint_from=whence, gpus_expected=gpn * len(job.nodes) if launcher.gpus else 0)
    if "memory" in wanted:
        memory = [i["gpu_memory_gib"] for i in infos if i.get("gpu_memory_gib")]
        checks.append(memory_check(cfg, min(memory, default=None)))
    return checks


def _node_step(cmd: list[str], env: dict, out: Path, nodes: list[str], timeout_s: float) -> list[Check]:
    log = out / "nodes.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            _stop(proc)
    checks = []
    for n in nodes:
        path = out / f"node_{n}.json"
        if path.exists():
            checks += [Check(**c) for c in json.loads(path.read_text())["checks"]]
        else:
            checks.append(fail("doctor.node", f"no report from {n} in {timeout_s:.0f} s", "a report",
                               f"read {log}; the node may be down or its Python environment broken", n))
    return checks


def node_step(cfg, out: Path) -> int:
    """One srun task (``python -m areal_mcore.launcher.slurm doctor-node``): this node's
    checks, written to ``out/node_<name>.json``."""
    from areal_mcore.net import free_port

    plan = json.loads((out / "roles.json").read_text())
    me = os.environ["SLURMD_NODENAME"]
    role = NodeRole(**plan["nodes"][me])
    checks, info, socks = node_checks(cfg, role, plan["master"], os.environ)
    deadline = time.monotonic() + cfg.doctor.timeout_s / 2
    rollout = [n for n, r in plan["nodes"].items() if r["servers"]]
    if "network" in cfg.doctor.checks and rollout:
        if role.servers:  # listen where the servers will, and wait for the trainer nodes to call
            for _ in range(role.servers - len(socks)):  # free ports, picked as the servers pick them
                sock = socket.socket()
                sock.bind((role.address, free_port(role.address)))
                sock.listen(16)
                socks.append(sock)
            addresses = [f"{role.address}:{sk.getsockname()[1]}" for sk in socks]
            _publish(out / f"listen_{me}.json", {"addresses": addresses})
            while time.monotonic() < deadline and not all((out / f"reached_{t}").exists()
                                                         for t in plan["trainer_nodes"]):
                time.sleep(0.2)
        if role.trainer:
            while time.monotonic() < deadline and not all((out / f"listen_{n}.json").exists() for n in rollout):
                time.sleep(0.2)
            targets = {n: json.loads((out / f"listen_{n}.json").read_text())["addresses"] for n in rollout
                       if (out / f"listen_{n}.json").exists()}
            missing = [n for n in rollout if n not in targets]
            check = reach_check(targets, me)
            if missing:
                check = fail("network.reach", f"no listening report from {', '.join(missing)}", "every rollout "
                             "node", "the rollout node's doctor task did not start: read the doctor's nodes.log", me)
            checks.append(check)
            (out / f"reached_{me}").touch()
    if role.trainer and "network" in cfg.doctor.checks:
        ib = infiniband_check(len(plan["trainer_nodes"]), role.gpus, me)
        checks += [ib] if ib else []
    for sock in socks:
        sock.close()
    first = plan["trainer_nodes"][0]
    if "fabric" in cfg.doctor.checks and rollout and (me == first or role.servers):
        checks.append(_weight_sync(cfg, out, me, first, rollout, role, plan["nodes"][first]["address"]))
    _publish(out / f"node_{me}.json", {"checks": [dataclasses.asdict(c) for c in checks], "info": info})
    return 0


def _weight_sync(cfg, out: Path, me: str, first: str, rollout: list[str], role: NodeRole, master: str) -> Check:
    """The first trainer node hosts a weight-update group that one task per rollout node joins."""
    import torch

    from areal_mcore.doctor.wsync import broadcast_probe
    from areal_mcore.net import free_port

    backend = cfg.weight_sync.backend
    if backend == "auto":  # as the trainer resolves it (weight_sync/distributed.py)
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(0)
    path, timeout = out / "wsync_master.json", cfg.doctor.timeout_s / 2
    if me == first:
        port = free_port(master)
        _publish(path, {"port": port})
    else:
        deadline = time.monotonic() + timeout
        while not path.exists():
            if time.monotonic() > deadline:
                return fail("weight_sync.broadcast", f"no group from {first} in {timeout:.0f} s", "a group",
                            f"the first trainer node's doctor task did not start: read {out / 'nodes.log'}", me)
            time.sleep(0.2)
        port = json.loads(path.read_text())["port"]
    rank = 0 if me == first else 1 + rollout.index(me)
    return broadcast_probe(backend=backend, master=master, port=port, rank=rank, world=1 + len(rollout),
                           mb=min(cfg.doctor.allreduce_mb, 64), timeout_s=timeout, where=me)


def _publish(path: Path, data: dict) -> None:
    write_atomic(path, json.dumps(data), fsync=False)  # other nodes read it whole or not at all


def report(files: RunDir, checks: list[Check], *, warn_only: bool = False, **about) -> int:
    """Prints the table, writes ``<run>/doctor.json`` (when the run directory takes it) and
    returns the exit code."""
    print(format_table(checks), flush=True)
    try:
        write_json(checks, files.path / "doctor.json", **about)
    except OSError as e:
        print(f"doctor: {files.path / 'doctor.json'} not written: {e.strerror or e}", file=sys.stderr)
    return exit_code(checks, warn_only=warn_only)
