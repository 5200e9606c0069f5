"""The rollout configs. ``ServerConfig``: what ``rollout/servers.py`` launches and the engine
adapters (``rollout/engines/``) build their command lines from; it holds the options every
engine shares, and a section per engine for the options only it reads (``server.vllm``,
from ``engines/options.py``). It imports no adapter, so the adapters can name it.
``RolloutConfig``: what is sampled (the episode, its sampling parameters) and how the
executor admits it (``rollout/executor.py``, ``rollout/admission.py``)."""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field
from typing import Any

from areal_mcore.checks import FieldError, check_choice, check_positive, field_error
from areal_mcore.dotted import import_dotted
from areal_mcore.rollout.engines.options import BACKENDS, VLLMOptions
from areal_mcore.rollout.protocol import SamplingParams


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
    # Server i listens on base_port + i (under Slurm too: a site's firewall may open one
    # range); None: free ports picked at launch.
    base_port: int | None = None
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


# boba's group of n single-turn samples (rollout/episodes/single_turn.py)
DEFAULT_EPISODE = "areal_mcore.rollout.episodes.single_turn:SingleTurn"


@dataclass(kw_only=True)
class RolloutConfig:
    max_new_tokens: int
    n_samples: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    # SGLang refuses min_new_tokens > 0 under --skip-tokenizer-init (server.skip_tokenizer_init).
    min_new_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    max_concurrent_rollouts: int = 64  # prompt groups' worth of requests in flight (x n_samples)
    # The client's generation connections (one per request in flight). None: exactly the
    # requests in flight, max_concurrent_rollouts x n_samples; a smaller cap would leave
    # requests waiting inside the client while the servers have room for them.
    max_connections: int | None = None
    max_head_offpolicyness: int = 4
    seed: int = 1
    # A server with requests in flight that answered none for stall_after_s and does not
    # answer /health within stall_probe_s is stalled (a hung engine, a stopped process, a
    # node gone with its connections open): its requests go to the others, and the weight
    # sync drops it. A healthy SGLang answers /health within its own 20 s check.
    stall_after_s: float = 300.0
    stall_probe_s: float = 30.0
    # A slow server (it answers, at a crawl: a degraded GPU, a throttled node): a request
    # whose attempt takes longer than its remaining tokens at 1/slow_request_factor of
    # the fleet's median measured rate (and min_request_deadline_s) is retried on another
    # server. 0: off (request_timeout_s only). With weight_sync.pause_mode retract or
    # in_place requests wait out a sync: min_request_deadline_s must exceed a sync.
    slow_request_factor: float = 10.0
    min_request_deadline_s: float = 60.0
    # A server whose answer breaks its engine's contract (not JSON, token ids outside the
    # served vocabulary, logprobs that are NaN or do not match the tokens) gets that
    # request retried elsewhere; after max_bad_answers bad answers within 100 of its
    # answers it is faulty: no more requests, and the next weight push drops it.
    max_bad_answers: int = 3
    # DAPO dynamic sampling: drop groups whose raw rewards are all equal (all wrong or all
    # right) and sample on until the batch holds trainer.batch_size mixed groups, looking
    # at most dynamic_sampling_max_rounds x batch_size groups for one step.
    dynamic_sampling: bool = False
    dynamic_sampling_max_rounds: int = 4
    # What one prompt turns into (rollout/episodes/__init__.py): package.module:name of a
    # factory called as factory(rollout_cfg, env, **episode_args) -> episode (and with
    # env=None at load, to check the arguments). The default is boba's group of n_samples
    # single-turn samples; episodes/tool_use.py:ToolCalls samples multi-turn with a tool.
    episode: str = DEFAULT_EPISODE
    episode_args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        self._check_episode()
        check_positive("dynamic_sampling_max_rounds", self.dynamic_sampling_max_rounds)
        check_positive("slow_request_factor", self.slow_request_factor, allow_zero=True)
        check_positive("min_request_deadline_s", self.min_request_deadline_s)
        check_positive("max_bad_answers", self.max_bad_answers)
        check_positive("n_samples", self.n_samples)
        check_positive("stall_after_s", self.stall_after_s)
        check_positive("stall_probe_s", self.stall_probe_s)
        check_positive("max_concurrent_rollouts", self.max_concurrent_rollouts)
        if self.max_connections is not None and self.max_connections < self.in_flight:
            raise field_error("max_connections", self.max_connections,
                              f"is below the requests in flight, max_concurrent_rollouts x n_samples = "
                              f"{self.max_concurrent_rollouts} x {self.n_samples} = {self.in_flight}: "
                              f"raise it to at least {self.in_flight}, or null (follows them)")
        check_positive("max_head_offpolicyness", self.max_head_offpolicyness, allow_zero=True)
        check_positive("min_new_tokens", self.min_new_tokens, allow_zero=True)

    def _check_episode(self) -> None:
        """The episode factory imports and takes ``episode_args`` (a typo fails at load).
        Factories are called once here with ``env=None`` to check their arguments."""
        try:
            factory = import_dotted(self.episode, DEFAULT_EPISODE, "factory")
        except ValueError as e:
            raise FieldError("episode", f"={self.episode!r} {e}") from None
        if not callable(factory):
            raise FieldError("episode", f"={self.episode!r} is a {type(factory).__name__}, not a factory "
                                        "called as factory(rollout_cfg, env, **episode_args)")
        try:
            inspect.signature(factory).bind(self, None, **self.episode_args)
        except TypeError as e:
            raise FieldError("episode_args", f"={dict(self.episode_args)} does not fit {self.episode}: {e}") from None
        except ValueError:  # no inspectable signature: the call below says
            pass
        try:  # env=None: the factory checks its arguments without building anything
            factory(self, None, **self.episode_args)
        except (TypeError, ValueError) as e:
            raise FieldError("episode_args", f"={dict(self.episode_args)} is refused by {self.episode}: {e}") from None

    @property
    def in_flight(self) -> int:
        """The most generate requests in flight at once (one per sample of each group)."""
        return self.max_concurrent_rollouts * self.n_samples

    @property
    def connections(self) -> int:
        """The client's generation connection limit (``max_connections``, resolved)."""
        return self.in_flight if self.max_connections is None else self.max_connections

    def sampling(self) -> SamplingParams:
        return SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                              top_p=self.top_p, top_k=self.top_k, min_new_tokens=self.min_new_tokens,
                              stop_token_ids=list(self.stop_token_ids))
