"""The eval and filter sections, what they take from the rest of an experiment config,
and boba's eval settings: sampling per model kind, and the rollout servers' long-context
settings.

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
from typing import TYPE_CHECKING

from areal_mcore.checks import FieldError, check_choice, check_positive, field_error
from areal_mcore.data.jsonl import FORMATS, THINK_MODES, DatasetConfig
from areal_mcore.reward.pool import RewardPoolConfig
from areal_mcore.rollout.config import ServerConfig

if TYPE_CHECKING:  # an annotation only: this leaf imports nothing of the rollout loop
    from areal_mcore.rollout.config import RolloutConfig

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
DEFAULT_MAX_PROMPT_TOKENS = 1024  # boba's length filter (and trainer.max_prompt_tokens' default)


@dataclass(kw_only=True)
class EvalConfig:
    """``areal-mcore eval``: the ``eval`` section. A None takes its value from the experiment's
    other sections, as ``eval_job`` says, else the default noted."""

    model_kind: str  # rl | sft | base: picks temperature/top_p
    data: list[str] = field(default_factory=list)  # JSONL files, one report row each; []: eval_dataset
    # Row format of ``data``. None: eval_dataset's, read and prompted as the run's eval set is
    # (instruction, think); another format reads the files as plain rows of that format.
    data_format: str | None = None
    n_samples: int = 32  # per problem
    temperature: float | None = None  # None: by model_kind
    top_p: float | None = None  # None: by model_kind
    ks: list[int] | None = None  # pass@k reported; None: powers of two up to n_samples, and n_samples
    max_new_tokens: int | None = None  # None: rollout.max_new_tokens, else boba's (27648)
    shuffle_choices: bool = False  # permute multiple-choice options (deterministic in seed)
    # Prompts are each dataset's training prompts (DatasetConfig.instruction and .think);
    # these opt into a different instruction ("" for none) or thinking prefix, and the eval
    # header and report say so.
    prompt_suffix: str | None = None
    think: str | None = None
    max_prompt_tokens: int | None = None  # longer prompts are dropped; None: trainer's, else keep all
    max_concurrent_rollouts: int = 64  # problems in flight (each n_samples requests)
    seed: int | None = None  # None: the run's eval seed, rollout.seed + 1, else 1
    out: str | None = None  # JSON report path
    progress: bool = True  # tqdm bar over each dataset's problems

    def __post_init__(self):
        check_choice("model_kind", self.model_kind, MODEL_KINDS)
        _check_sampling(self)
        if self.data_format is not None:
            check_choice("data_format", self.data_format, FORMATS)
        if self.think is not None:
            check_choice("think", self.think, THINK_MODES)
        for key in ("n_samples", "max_new_tokens", "max_prompt_tokens", "max_concurrent_rollouts"):
            if getattr(self, key) is not None:
                check_positive(key, getattr(self, key))
        for k in self.ks or []:
            if not 1 <= k <= self.n_samples:
                raise FieldError("ks", f": pass@{k} needs k <= n_samples, got k={k} and n_samples={self.n_samples}: "
                                 f"lower k or raise n_samples")


@dataclass(kw_only=True)
class FilterConfig:
    """``areal-mcore filter``: the ``filter`` section. The rows filtered are ``dataset``'s
    (a JSONL file, read and prompted as training reads it); a None takes its value from the
    experiment's other sections, as ``filter_job`` says, else the default noted."""

    out: str  # kept rows (JSONL); difficulty's progress in <out>.samples.jsonl
    samples: str | None = None  # difficulty: precomputed completions (JSONL); None: sampled here
    k: int = 8  # difficulty: problems solved in k of k samples are dropped
    model_kind: str = "base"  # boba samples the base model: 0.6/0.95
    temperature: float | None = None  # None: by model_kind
    top_p: float | None = None  # None: by model_kind
    max_new_tokens: int | None = None  # None: rollout.max_new_tokens, else boba's (27648)
    seed: int = 1
    chunk: int = 64  # problems in flight between two appends to the samples file
    progress: bool = True  # tqdm bar over the problems
    max_prompt_tokens: int | None = None  # length: None: trainer.max_prompt_tokens, else 1024

    def __post_init__(self):
        check_choice("model_kind", self.model_kind, MODEL_KINDS)
        _check_sampling(self)
        for key in ("k", "max_new_tokens", "chunk", "max_prompt_tokens"):
            if getattr(self, key) is not None:
                check_positive(key, getattr(self, key))


def _check_sampling(cfg: EvalConfig | FilterConfig) -> None:
    if cfg.temperature is not None:
        check_positive("temperature", cfg.temperature, allow_zero=True)
    if cfg.top_p is not None and not 0 < cfg.top_p <= 1:
        raise field_error("top_p", cfg.top_p, "must be in (0, 1]")


def sampling(cfg: EvalConfig | FilterConfig) -> tuple[float, float]:
    """(temperature, top_p): the model kind's, unless set."""
    temperature, top_p = SAMPLING_BY_KIND[cfg.model_kind]
    return (temperature if cfg.temperature is None else cfg.temperature,
            top_p if cfg.top_p is None else cfg.top_p)


@dataclass(kw_only=True)
class EvalJob:
    """What ``evaluate`` runs: the eval section with its Nones resolved (``eval_job``)."""

    eval: EvalConfig
    datasets: list[DatasetConfig]
    server: ServerConfig  # model_path: the model evaluated; addresses: servers already running
    tokenizer_path: str
    reward: RewardPoolConfig
    # The experiment's rollout section (None: none): the client's request policy (stall
    # detection, deadlines, bad answers), as the run's own client has it.
    rollout: RolloutConfig | None = None


@dataclass(kw_only=True)
class FilterJob:
    """What the filters run: the filter section with its Nones resolved (``filter_job``)."""

    filter: FilterConfig
    dataset: DatasetConfig
    server: ServerConfig  # model_path: the model sampled; addresses: servers already running
    tokenizer_path: str | None  # None: no model named (scoring precomputed samples needs none)
    reward: RewardPoolConfig
    rollout: RolloutConfig | None = None  # as EvalJob.rollout


# What eval and the filters take from the rest of an experiment config is resolved in the
# two functions below and nowhere else. ``cfg`` is the root config (config.py's
# InferenceConfig, or the ExperimentConfig built on it), read by attribute: config.py
# imports this module, not the other way round.


def eval_job(cfg) -> EvalJob:
    """The eval section of ``cfg`` with the experiment's model, servers, reward, eval set,
    rollout budget and seed, and prompt limit filled in."""
    e, rollout, trainer = cfg.eval, cfg.rollout, cfg.trainer
    if e is None:
        raise ValueError("no eval settings: give --model-kind rl|sft|base (eval.model_kind=...), "
                         "or --config with an eval section")
    server = cfg.server or ServerConfig(model_path=cfg.model_path)
    if not server.model_path:
        raise ValueError("no model to evaluate: give --model HF_FOLDER (server.model_path=...), "
                         "or --config with model_path")
    base = cfg.eval_dataset or cfg.dataset
    if e.data:
        fmt = e.data_format or (base.format if base else "boba")
        same = base is not None and base.format == fmt
        datasets = [dataclasses.replace(base, path=path) if same else DatasetConfig(path=path, format=fmt)
                    for path in e.data]
    elif cfg.eval_dataset:
        datasets = [cfg.eval_dataset]
    else:
        raise ValueError("no dataset to evaluate: give --data a.jsonl[,b.jsonl] (eval.data=[...]), "
                         "or --config with eval_dataset")
    resolved = dataclasses.replace(
        e, max_new_tokens=e.max_new_tokens or (rollout.max_new_tokens if rollout else DEFAULT_MAX_NEW_TOKENS),
        max_prompt_tokens=e.max_prompt_tokens or (trainer.max_prompt_tokens if trainer else None),
        # The run's periodic eval samples with rollout.seed + 1 (trainer/ppo.py): the same
        # seeds draw the same samples from the same weights.
        seed=e.seed if e.seed is not None else (rollout.seed + 1 if rollout else 1))
    return EvalJob(eval=resolved, datasets=datasets, server=server,
                   tokenizer_path=cfg.tokenizer_path or server.model_path, reward=cfg.reward, rollout=rollout)


def filter_job(cfg) -> FilterJob:
    """The filter section of ``cfg`` with the experiment's dataset, model, servers, reward,
    rollout budget and prompt limit filled in."""
    f, rollout, trainer = cfg.filter, cfg.rollout, cfg.trainer
    if f is None:
        raise ValueError("no filter settings: give --out FILE.jsonl (filter.out=...), or --config with a filter section")
    if cfg.dataset is None:
        raise ValueError("no dataset to filter: give --data FILE.jsonl (dataset.path=...), or --config with dataset")
    server = cfg.server or ServerConfig(model_path=cfg.model_path)
    resolved = dataclasses.replace(
        f, max_new_tokens=f.max_new_tokens or (rollout.max_new_tokens if rollout else DEFAULT_MAX_NEW_TOKENS),
        max_prompt_tokens=f.max_prompt_tokens or (trainer.max_prompt_tokens if trainer else DEFAULT_MAX_PROMPT_TOKENS))
    return FilterJob(filter=resolved, dataset=cfg.dataset, server=server,
                     tokenizer_path=cfg.tokenizer_path or server.model_path, reward=cfg.reward, rollout=rollout)


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
