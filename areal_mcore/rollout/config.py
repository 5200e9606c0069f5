"""The rollout servers' config: what ``rollout/servers.py`` launches and the engine
adapters (``rollout/engines/``) build their command lines from. ``ServerConfig`` holds the
options every engine shares, and a section per engine for the options only it reads
(``server.vllm``, from ``engines/options.py``). It imports no adapter, so the adapters can
name it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from areal_mcore.checks import check_choice, check_positive, field_error
from areal_mcore.rollout.engines.options import BACKENDS, VLLMOptions


@dataclass(kw_only=True)
class ServerConfig:
    model_path: str | None = None  # None: the root config's model_path (config.py fills it in)
    backend: str = "embedded"
    n_servers: int = 1
    tp_size: int = 1
    mem_fraction_static: float = 0.9  # of each GPU (SGLang; vLLM's --gpu-memory-utilization)
    context_length: int = 32768
    dtype: str = "bfloat16"
    seed: int = 1
    host: str = "127.0.0.1"
    base_port: int | None = None  # None: free ports picked at launch
    # The key every route but /health needs; None: $AREAL_ROLLOUT_API_KEY, else a random
    # one per launch (rollout/auth.py). Never passed on a command line.
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
    # GPU indices of this node for the servers launched here (server i takes tp_size of
    # them in order). None: with CUDA, the GPUs after the trainer's (torchrun's
    # LOCAL_WORLD_SIZE ranks on GPUs 0..), never the trainer's own.
    gpus: list[int] | None = None
    # MoE: start the servers keeping the experts each token was routed to
    # (--enable-return-routed-experts of vLLM 0.32, SGLang 0.5.23 and the embedded server),
    # for actor.router_replay and the moe/router_disagreement stat (docs/models.md).
    return_routed_experts: bool = False
    # vLLM's own options (backend=vllm only).
    vllm: VLLMOptions = field(default_factory=VLLMOptions)

    def __post_init__(self):
        self.addresses = [a.removeprefix("http://") for a in self.addresses]  # the client adds it
        check_choice("backend", self.backend, BACKENDS)
        check_positive("n_servers", self.n_servers)
        check_positive("tp_size", self.tp_size)
        if not 0 < self.mem_fraction_static <= 1:
            raise field_error("mem_fraction_static", self.mem_fraction_static, "must be in (0, 1]")
        if self.backend == "embedded" and self.tp_size != 1:
            raise field_error("tp_size", self.tp_size, "must be 1 with backend=embedded (one process per server)")
        if self.gpus is not None and len(self.gpus) != self.n_servers * self.tp_size:
            raise field_error("gpus", self.gpus, f"must list n_servers x tp_size = {self.n_servers * self.tp_size} "
                                                 f"GPU indices, {self.tp_size} per server")
        # Only the chosen engine's adapter reads its section: a value set in another
        # engine's would be dropped without a word.
        if self.backend != "vllm":
            default = VLLMOptions()
            for f in dataclasses.fields(self.vllm):
                value = getattr(self.vllm, f.name)
                if value != getattr(default, f.name):
                    raise field_error(f"vllm.{f.name}", value, f"is a vLLM option, but backend={self.backend!r} "
                                                               "starts no vLLM server: remove it, or set backend=vllm")
