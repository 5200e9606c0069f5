"""The eval's config and boba's eval settings: sampling per model kind, and the rollout
servers' long-context settings.

boba's eval advice for long (up to 32K-token) reasoning traces: no CUDA graphs, no chunked
prefill, no sliding-window attention, trading throughput for the numerics its reported
results were measured with. On SGLang these are ``--disable-cuda-graph`` and
``--chunked-prefill-size -1`` (SGLang's server-arguments reference: "Setting this to -1
means disabling chunked prefill"). SGLang has no sliding-window switch (vLLM's
``--disable-sliding-window`` does not exist there): its Qwen2/LLaMA attention is always
full, so the remaining risk is a model whose HF config turns sliding windows on, which
``check_full_attention`` refuses.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from areal_mcore.checks import FieldError, check_choice, check_positive, field_error
from areal_mcore.data.jsonl import THINK_MODES, DatasetConfig
from areal_mcore.reward.pool import RewardPoolConfig
from areal_mcore.rollout.config import ServerConfig

MODEL_KINDS = ("rl", "sft", "base")
# (temperature, top_p): boba samples SFT and base models at 0.6/0.95, RL models at 1.0/1.0.
SAMPLING_BY_KIND = {"rl": (1.0, 1.0), "sft": (0.6, 0.95), "base": (0.6, 0.95)}
EVAL_SGLANG_ARGS = ("--disable-cuda-graph", "--chunked-prefill-size", "-1")
# The same settings for vLLM (flags of vllm 0.32's engine/arg_utils.py), plus full
# attention as boba evaluates (check_full_attention refuses a sliding-window config too).
EVAL_VLLM_ARGS = ("--enforce-eager", "--no-enable-chunked-prefill", "--disable-custom-all-reduce",
                  "--disable-sliding-window")
# boba's response budget: 27648 new tokens leave 5120 of SGLang's 32768 context to the prompt.
DEFAULT_MAX_NEW_TOKENS = 27648


@dataclass(kw_only=True)
class EvalConfig:
    datasets: list[DatasetConfig]  # one report row each
    server: ServerConfig  # model_path is the model evaluated; addresses: servers already running
    model_kind: str  # rl | sft | base: picks temperature/top_p
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    tokenizer_path: str | None = None  # None: server.model_path
    n_samples: int = 32  # per problem
    temperature: float | None = None  # None: by model_kind
    top_p: float | None = None  # None: by model_kind
    ks: list[int] | None = None  # pass@k reported; None: powers of two up to n_samples, and n_samples
    shuffle_choices: bool = False  # permute multiple-choice options (deterministic in seed)
    # Prompts are each dataset's training prompts (DatasetConfig.instruction and .think);
    # these opt into a different instruction ("" for none) or thinking prefix, and the eval
    # header and report say so.
    prompt_suffix: str | None = None
    force_think: str | None = None
    max_prompt_tokens: int | None = None  # longer prompts are dropped and counted; None: keep all
    max_concurrent_rollouts: int = 64  # problems in flight (each n_samples requests)
    seed: int = 1
    reward: RewardPoolConfig = field(default_factory=RewardPoolConfig)
    out: str | None = None  # JSON report path

    def __post_init__(self):
        check_choice("model_kind", self.model_kind, MODEL_KINDS)
        if self.force_think is not None:
            check_choice("force_think", self.force_think, THINK_MODES)
        if not self.datasets:
            raise FieldError("datasets", ": no datasets to evaluate: give at least one JSONL file")
        for key in ("n_samples", "max_new_tokens", "max_concurrent_rollouts"):
            check_positive(key, getattr(self, key))
        if self.temperature is not None:
            check_positive("temperature", self.temperature, allow_zero=True)
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise field_error("top_p", self.top_p, "must be in (0, 1]")
        for k in self.ks or []:
            if not 1 <= k <= self.n_samples:
                raise FieldError("ks", f": pass@{k} needs k <= n_samples, got k={k} and n_samples={self.n_samples}: "
                                 f"lower k or raise n_samples")

    def sampling(self) -> tuple[float, float]:
        """(temperature, top_p): the model kind's, unless set."""
        temperature, top_p = SAMPLING_BY_KIND[self.model_kind]
        return (temperature if self.temperature is None else self.temperature,
                top_p if self.top_p is None else self.top_p)


def eval_server_config(server: ServerConfig) -> ServerConfig:
    """``server`` with boba's long-context eval settings for the servers eval launches."""
    check_full_attention(server.model_path)
    if server.backend == "sglang":
        # Before the user's extra_args, so that theirs win where argparse takes the last value.
        return dataclasses.replace(server, extra_args=[*EVAL_SGLANG_ARGS, *server.extra_args])
    if server.backend == "vllm":
        return dataclasses.replace(server, extra_args=[*EVAL_VLLM_ARGS, *server.extra_args])
    # The embedded server already matches them (and its argparse rejects SGLang's flags):
    # eager PyTorch, each prompt prefilled whole, attention as the HF config says.
    return server


def check_full_attention(model_path: str) -> None:
    """Refuses a model whose HF config turns on sliding-window attention."""
    path = Path(model_path) / "config.json"
    if path.is_file() and json.loads(path.read_text()).get("use_sliding_window"):
        raise ValueError(f"{path}: use_sliding_window is true; boba evaluates with full attention "
                         f"(set it to false in config.json)")
