"""Starts rollout servers as subprocesses: SGLang or vLLM, or the embedded server on CPU.

All are launched from one ``ServerConfig`` (each engine's command line and environment
come from ``rollout/engines/``); each server gets its own port and its own
random seed (``seed + index``), so n servers never draw the same samples.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

from areal_mcore.checks import field_error
from areal_mcore.net import free_port, healthy, listens_within, port_holder, set_nccl_env
from areal_mcore.procs import child_env, die_with_parent
from areal_mcore.rollout.auth import configured_key
from areal_mcore.rollout.config import ServerConfig
from areal_mcore.rollout.engines import engine_for


def server_gpus(cfg: ServerConfig, *, gpu_count: int, trainer_gpus: int,
                visible: str | None = None) -> list[str | None]:
    """Each server's ``CUDA_VISIBLE_DEVICES`` on a node with ``gpu_count`` GPUs whose first
    ``trainer_gpus`` the trainer's ranks hold; None each on a CPU node. Without it every
    server inherits the trainer's environment and starts on GPU 0, beside trainer rank 0
    (SGLang's --base-gpu-id and vLLM both default to the first visible GPU). Indices are
    this process's; ``visible`` (its own CUDA_VISIBLE_DEVICES) maps them to the node's."""
    if gpu_count == 0 and cfg.gpus is None:
        return [None] * cfg.n_servers
    gpus = list(cfg.gpus) if cfg.gpus is not None else list(range(trainer_gpus, gpu_count))
    need = cfg.n_servers * cfg.tp_size
    if len(gpus) < need or any(not 0 <= g < gpu_count for g in gpus):
        raise field_error("gpus", cfg.gpus, f"{cfg.n_servers} servers x tp_size {cfg.tp_size} need {need} "
                                            f"GPUs besides the trainer's {trainer_gpus}; this node has {gpu_count}: "
                                            f"list the servers' GPUs (server.gpus) or start fewer servers")
    names = visible.split(",") if visible else [str(g) for g in range(gpu_count)]
    tp = cfg.tp_size
    return [",".join(names[g] for g in gpus[i * tp:(i + 1) * tp]) for i in range(cfg.n_servers)]


def server_command(cfg: ServerConfig, *, port: int, seed: int) -> list[str]:
    """The command line of one server."""
    return engine_for(cfg.backend).command(cfg, port=port, seed=seed)


class ServerProcess:
    """One server subprocess in its own session (so stop() takes its children too)."""

    def __init__(self, cmd: list[str], *, host: str, port: int, log_path: str,
                 env: dict | None = None):
        self.cmd, self.host, self.port, self.log_path = cmd, host, port, log_path
        os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
        # Owner-only: SGLang logs its server args, the API key among them, at start-up.
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.fchmod(fd, 0o600)  # a log from before keeps its mode otherwise
        self._log = os.fdopen(fd, "ab")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True, env=env, preexec_fn=die_with_parent)

    @property
    def address(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"{host}:{self.port}"

    def wait_healthy(self, timeout_s: float) -> None:
        """Polls ``/health``; raises with the log tail if the process dies or times out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if self.lost_its_port():
                    raise PortTaken(self.port, port_holder(self.port))
                raise RuntimeError(f"rollout server exited with code {self.proc.returncode} before "
                                   f"it was healthy ({' '.join(self.cmd[:4])} ...); last log lines "
                                   f"of {self.log_path}:\n{self.log_tail()}")
            # Healthy and ours: another job's server on this port answers /health too,
            # and would get this run's requests and weights (ours then dies of EADDRINUSE).
            if healthy(self.address) and listens_within(self.proc.pid, self.port):
                return
            time.sleep(0.2)
        self.stop()
        holder = port_holder(self.port)
        if holder is not None:  # our server never bound it (it may hang rather than exit)
            raise PortTaken(self.port, holder)
        raise TimeoutError(f"rollout server {self.address} not healthy after {timeout_s:.0f} s; "
                           f"log {self.log_path}:\n{self.log_tail()}")

    def lost_its_port(self) -> bool:
        """Whether the server exited because its port was taken (uvicorn, aiohttp and
        SGLang all end with errno 98's message)."""
        return self.proc.poll() is not None and "address already in use" in self.log_tail(50).lower()

    def log_tail(self, lines: int = 20) -> str:
        with open(self.log_path, "rb") as f:
            return b"".join(f.readlines()[-lines:]).decode(errors="replace")

    def kill(self) -> None:
        """SIGKILL the whole process group, no grace (what a node failure looks like)."""
        self._signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self, grace_s: float = 10.0) -> None:
        if self.proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()

    def _signal(self, sig) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass


class PortTaken(RuntimeError):
    """A server's port is held by another process (a run's own server would share it)."""

    def __init__(self, port: int, holder: tuple[int | None, str] | None):
        self.port, self.holder = port, holder
        who = (f"pid {holder[0]} ({holder[1]})" if holder and holder[0] else
               holder[1] if holder else "a process that has let it go since")
        super().__init__(f"port {port} is taken by {who}")


def check_ports_free(cfg: ServerConfig) -> None:
    """With ``server.base_port``, the ports of the servers to launch are free now; raises
    a one-line config error naming the port and its holder. Without this, another job's
    server on the port answered our /health, joined our weight-update group and got our
    weights and requests, while our own server died of EADDRINUSE with an empty log."""
    if not cfg.base_port or cfg.addresses:
        return
    for port in range(cfg.base_port, cfg.base_port + cfg.n_servers):
        holder = port_holder(port)
        if holder is not None:
            raise field_error("server.base_port", cfg.base_port,
                              f"cannot be used: {PortTaken(port, holder)}; choose another server.base_port "
                              f"(ports base_port..base_port+n_servers-1), or unset it to pick free ports")


def launch_servers(cfg: ServerConfig, *, default_log_dir: str | None = None,
                   env: dict | None = None, api_key: str | None = None,
                   weights_root: str | None = None) -> list[ServerProcess]:
    """Starts ``cfg.n_servers`` servers and waits until each answers ``/health``; they log
    under ``cfg.log_dir``, else ``default_log_dir`` (the caller's output), else logs/rollout.
    ``env`` (default this process's) loses torchrun's variables either way (``procs.child_env``).
    ``api_key``: the key every route but /health requires (None: the configured one,
    ``auth.configured_key``, or none; the trainer and eval pass ``auth.launch_key``'s);
    ``weights_root``: the folder update_weights_from_disk may read from (embedded only).
    Both reach the engine by ``Engine.auth``: never the key on a command line."""
    check_ports_free(cfg)
    log_dir = cfg.log_dir or default_log_dir or "logs/rollout"
    servers: list[ServerProcess] = []
    engine = engine_for(cfg.backend)
    env = engine.env(cfg, child_env(env))  # a server is no rank of ours
    auth_args, env = engine.auth(cfg, env, api_key=api_key or configured_key(cfg, env),
                                 weights_root=weights_root, private_dir=log_dir)
    set_nccl_env(env)  # the weight-update group's settings, as the trainer's
    gpus = server_gpus(cfg, gpu_count=_gpu_count(), trainer_gpus=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                       visible=os.environ.get("CUDA_VISIBLE_DEVICES"))

    def start(i: int) -> ServerProcess:
        port = cfg.base_port + i if cfg.base_port else free_port(cfg.host)
        mine = env if gpus[i] is None else {**env, "CUDA_VISIBLE_DEVICES": gpus[i]}
        return ServerProcess(server_command(cfg, port=port, seed=cfg.seed + i) + auth_args, host=cfg.host,
                             port=port, log_path=os.path.join(log_dir, f"server{i}.log"), env=mine)

    try:
        for i in range(cfg.n_servers):
            servers.append(start(i))
        for i in range(cfg.n_servers):
            # A picked port can be taken before the server binds it (net.free_port): a
            # server that died of that alone is started again on another port.
            for retry in range(_BIND_RETRIES + 1):
                try:
                    servers[i].wait_healthy(cfg.startup_timeout_s)
                    break
                except PortTaken as e:
                    if cfg.base_port:
                        raise field_error("server.base_port", cfg.base_port, f"cannot be used: {e} (it was "
                                          "free when checked); choose another server.base_port, or "
                                          "unset it to pick free ports") from None
                    if retry == _BIND_RETRIES:
                        raise
                    servers[i].stop(grace_s=0)
                    servers[i] = start(i)
    except BaseException:
        for s in servers:
            s.stop(grace_s=2)
        raise
    return servers


_BIND_RETRIES = 2


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
