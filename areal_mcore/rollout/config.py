"""The rollout servers' config: what ``rollout/servers.py`` launches and the engine
adapters (``rollout/engines/``) build their command lines from. A leaf: it imports no
adapter, so the adapters can name it."""

from __future__ import annotations

from dataclasses import dataclass, field

from areal_mcore.checks import check_choice, check_positive, field_error

BACKENDS = ("sglang", "embedded", "vllm")  # one adapter each (engines/__init__.py engine_for)
TRANSFER_BACKENDS = ("auto", "areal_gloo", "nccl")


@dataclass(kw_only=True)
class ServerConfig:
    model_path: str | None = None  # None: the root config's model_path (config.py fills it in)
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
    # Servers already running (host:port; an http:// prefix is dropped); when set, nothing is launched.
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
        self.addresses = [a.removeprefix("http://") for a in self.addresses]  # the client adds it
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
