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
from dataclasses import dataclass, field

from areal_mcore.checks import check_choice, check_positive, field_error
from areal_mcore.net import free_port, healthy, set_nccl_env
from areal_mcore.procs import die_with_parent
from areal_mcore.rollout.engines import BACKENDS, engine_for

TRANSFER_BACKENDS = ("auto", "areal_gloo", "nccl")


@dataclass(kw_only=True)
class ServerConfig:
    model_path: str
    backend: str = "embedded"
    n_servers: int = 1
    tp_size: int = 1
    mem_fraction_static: float = 0.9
    context_length: int = 32768
    dtype: str = "bfloat16"
    seed: int = 1
    host: str = "127.0.0.1"
    base_port: int | None = None  # None: free ports picked at launch
    api_key: str | None = None
    max_running_requests: int = 64
    skip_tokenizer_init: bool = True
    log_dir: str | None = None  # None: the launching tool's default (the trainer's: <run>/servers)
    startup_timeout_s: float = 600.0
    extra_args: list[str] = field(default_factory=list)
    # Servers already running (host:port); when set, nothing is launched.
    addresses: list[str] = field(default_factory=list)
    # The interpreter that runs the server; None: this one (vLLM on CPU: .venv-vllm).
    python: str | None = None
    # vLLM only: its weight-transfer engine (auto: nccl with CUDA, else our areal_gloo
    # plugin), the KV cache size (None: mem_fraction_static on GPU; on CPU, where that is a
    # fraction of the host's memory, sized from the run: engines/vllm.py cpu_kv_cache_bytes)
    # and eager mode (no torch.compile: starts ~40 s sooner on CPU).
    weight_transfer_backend: str = "auto"
    kv_cache_memory_mb: float | None = None
    enforce_eager: bool = False
    # GPU indices of this node for the servers launched here (server i takes tp_size of
    # them in order). None: with CUDA, the GPUs after the trainer's (torchrun's
    # LOCAL_WORLD_SIZE ranks on GPUs 0..), never the trainer's own.
    gpus: list[int] | None = None

    def __post_init__(self):
        check_choice("backend", self.backend, BACKENDS)
        check_positive("n_servers", self.n_servers)
        check_positive("tp_size", self.tp_size)
        if not 0 < self.mem_fraction_static <= 1:
            raise field_error("mem_fraction_static", self.mem_fraction_static, "must be in (0, 1]")
        check_choice("weight_transfer_backend", self.weight_transfer_backend, TRANSFER_BACKENDS)
        if self.backend == "embedded" and self.tp_size != 1:
            raise field_error("tp_size", self.tp_size, "must be 1 with backend=embedded (one process per server)")
        if self.gpus is not None and len(self.gpus) != self.n_servers * self.tp_size:
            raise field_error("gpus", self.gpus, f"must list n_servers x tp_size = {self.n_servers * self.tp_size} "
                                                 f"GPU indices, {self.tp_size} per server")


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
        self._log = open(log_path, "ab")
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
                raise RuntimeError(f"rollout server exited with code {self.proc.returncode} before "
                                   f"it was healthy ({' '.join(self.cmd[:4])} ...); last log lines "
                                   f"of {self.log_path}:\n{self.log_tail()}")
            if healthy(self.address):
                return
            time.sleep(0.2)
        self.stop()
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


def launch_servers(cfg: ServerConfig, *, default_log_dir: str | None = None,
                   env: dict | None = None) -> list[ServerProcess]:
    """Starts ``cfg.n_servers`` servers and waits until each answers ``/health``; they log
    under ``cfg.log_dir``, else ``default_log_dir`` (the caller's output), else logs/rollout."""
    log_dir = cfg.log_dir or default_log_dir or "logs/rollout"
    servers: list[ServerProcess] = []
    env = engine_for(cfg.backend).env(cfg, dict(os.environ) if env is None else env)
    set_nccl_env(env)  # the weight-update group's settings, as the trainer's
    gpus = server_gpus(cfg, gpu_count=_gpu_count(), trainer_gpus=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                       visible=os.environ.get("CUDA_VISIBLE_DEVICES"))

    def start(i: int) -> ServerProcess:
        port = cfg.base_port + i if cfg.base_port else free_port(cfg.host)
        mine = env if gpus[i] is None else {**env, "CUDA_VISIBLE_DEVICES": gpus[i]}
        return ServerProcess(server_command(cfg, port=port, seed=cfg.seed + i), host=cfg.host,
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
                except RuntimeError:
                    if cfg.base_port or retry == _BIND_RETRIES or not servers[i].lost_its_port():
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
