"""Typed configs: one ``@dataclass(kw_only=True)`` per component, YAML + ``a.b.c=value``.

``load_config(path, overrides)`` merges a YAML file and command-line overrides into the
dataclasses through OmegaConf structured configs. Unknown keys, wrong types and missing
required values raise :class:`ConfigError` naming the key, where it came from
(``file:line`` or the override) and the fix (nearest valid key, expected type).
Each dataclass validates its own values in ``__post_init__``.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import (
    ConfigKeyError,
    OmegaConfBaseException,
    ValidationError,
)

from areal_mcore.algo.normalize import LEVELS as NORM_LEVELS
from areal_mcore.data.jsonl import DatasetConfig
from areal_mcore.kernels import KERNEL_CHOICES as KERNELS
from areal_mcore.launcher.config import LaunchConfig
from areal_mcore.plan.config import PlanConfig
from areal_mcore.reward.pool import RewardPoolConfig
from areal_mcore.rollout.controller import RolloutConfig
from areal_mcore.rollout.launcher import ServerConfig
from areal_mcore.trainer.wandb_log import WandbConfig
from areal_mcore.weight_sync.syncer import WeightSyncConfig


class ConfigError(ValueError):
    """A config the user must fix; the message says where and how."""


# Validation messages start with the bare key; load_config prefixes the dotted path.
def _check_choice(key: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{key}={value!r} is not allowed; choose one of {list(allowed)}")


def _check_positive(key: str, value: float, *, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{key}={value!r} must be {'>= 0' if allow_zero else '> 0'}")


def _check_unit_interval(key: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{key}={value!r} must be in [0, 1]")


# --------------------------------------------------------------------------- components


@dataclass(kw_only=True)
class MicroBatchSpec:
    """How a batch is split into micro-batches (see ``packing.allocate_micro_batches``)."""

    max_tokens_per_mb: int
    min_mbs: int = 1
    # Micro-batch count must be a multiple of this (e.g. PP size for interleaved schedules).
    divisor: int = 1

    def __post_init__(self):
        for key in ("max_tokens_per_mb", "min_mbs", "divisor"):
            _check_positive(key, getattr(self, key))




@dataclass(kw_only=True)
class NormConfig:
    """Mean/std normalisation of rewards or advantages (``algo.normalize``)."""

    mean_level: str = "batch"
    std_level: str = "batch"
    # Samples per prompt; 'group' levels normalise over contiguous runs of this size.
    # null: rollout.n_samples (ExperimentConfig fills it in and refuses a mismatch).
    group_size: int | None = None
    unbiased_std: bool = False
    eps: float = 1e-5

    def __post_init__(self):
        _check_choice("mean_level", self.mean_level, NORM_LEVELS)
        _check_choice("std_level", self.std_level, NORM_LEVELS)
        if self.group_size is not None:
            _check_positive("group_size", self.group_size)
        _check_positive("eps", self.eps, allow_zero=True)

    @property
    def uses_groups(self) -> bool:
        return "group" in (self.mean_level, self.std_level)


PROX_LOGP_METHODS = ("recompute", "loglinear")
TRAINER_MODES = ("sync", "async")


@dataclass(kw_only=True)
class PPOConfig:
    """The boba PPO algorithm: reward shaping, advantages and the clipped actor loss."""

    ppo_n_minibatches: int = 1
    eps_clip: float = 0.2
    # Asymmetric upper clip (DAPO "clip-higher"); None means eps_clip.
    eps_clip_high: float | None = None
    # Dual clip for negative advantages (Ye et al. 2020); None disables; must be > 1.
    c_clip: float | None = None
    use_decoupled_loss: bool = False
    # Tokens whose behaviour weight exp(prox - behave) exceeds this (or is not finite)
    # are dropped from the loss and counted (train/behav_dropped_ratio).
    behav_imp_weight_cap: float | None = None
    # recompute: a forward pass before training; loglinear: AReaL's interpolation between
    # the behaviour and current logprobs (needs use_decoupled_loss: it *is* the proximal
    # of the decoupled loss, and without it nothing corrects for the behaviour policy).
    prox_logp_method: str = "recompute"
    discount: float = 1.0
    gae_lambda: float = 1.0
    reward_bias: float = 0.0
    reward_scaling: float = 1.0
    reward_clip: float = 20.0
    reward_norm: NormConfig | None = None
    adv_norm: NormConfig | None = None
    # GAE (kernels/gae.py): "auto" is Triton on GPU with triton installed, torch otherwise.
    gae_kernel: str = "auto"

    def __post_init__(self):
        _check_positive("ppo_n_minibatches", self.ppo_n_minibatches)
        _check_positive("eps_clip", self.eps_clip)
        if self.eps_clip_high is not None:
            _check_positive("eps_clip_high", self.eps_clip_high)
        if self.c_clip is not None and self.c_clip <= 1.0:
            raise ValueError(f"c_clip={self.c_clip} must be > 1 (or null to disable)")
        if self.behav_imp_weight_cap is not None and self.behav_imp_weight_cap <= 1.0:
            raise ValueError(
                f"behav_imp_weight_cap={self.behav_imp_weight_cap} must be > 1 (or null)"
            )
        _check_choice("prox_logp_method", self.prox_logp_method, PROX_LOGP_METHODS)
        if self.prox_logp_method == "loglinear" and not self.use_decoupled_loss:
            raise ValueError(
                "prox_logp_method='loglinear' needs use_decoupled_loss=true: the interpolated "
                "proximal policy stands in for the recomputed one of the decoupled loss; without "
                "the behaviour weight the loss trains against an interpolation with no correction "
                "for the policy that sampled the tokens (use prox_logp_method=recompute)"
            )
        if self.adv_norm is not None and self.adv_norm.uses_groups:
            key = "mean_level" if self.adv_norm.mean_level == "group" else "std_level"
            raise ValueError(
                f"adv_norm.{key}='group' is not supported: advantages are per token; normalise "
                "rewards per group with reward_norm and advantages with 'batch' or 'none'"
            )
        _check_choice("gae_kernel", self.gae_kernel, KERNELS)
        for key in ("discount", "gae_lambda"):
            _check_unit_interval(key, getattr(self, key))
        _check_positive("reward_clip", self.reward_clip)


LR_SCHEDULERS = ("constant", "linear", "cosine")


@dataclass(kw_only=True)
class OptimizerConfig:
    """Adam(W) on the megatron DistributedOptimizer, with warmup + decay."""

    lr: float
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    lr_scheduler: str = "constant"
    warmup_steps_proportion: float = 0.0
    min_lr_ratio: float = 0.0
    gradient_clipping: float = 1.0

    def __post_init__(self):
        _check_positive("lr", self.lr)
        _check_positive("eps", self.eps)
        _check_positive("weight_decay", self.weight_decay, allow_zero=True)
        _check_choice("lr_scheduler", self.lr_scheduler, LR_SCHEDULERS)
        for key in ("beta1", "beta2", "warmup_steps_proportion", "min_lr_ratio"):
            _check_unit_interval(key, getattr(self, key))
        _check_positive("gradient_clipping", self.gradient_clipping, allow_zero=True)


SEQUENCE_PARALLEL = ("auto", "true", "false")


@dataclass(kw_only=True)
class ParallelConfig:
    """Megatron model parallelism; data parallelism is what remains of the world size."""

    tp: int = 1
    pp: int = 1
    # Megatron sequence parallelism: activations outside the TP regions (norms, residual)
    # sharded over the TP ranks along the tokens. "auto": on when tp > 1 (as slime, AReaL
    # and verl run TP); "true"/"false" force it.
    sequence_parallel: str = "auto"
    # Uneven pipeline split: layers of the first (embedding) / last (LM head) stage; the
    # other stages share the rest equally. None: an equal split.
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None

    def __post_init__(self):
        _check_positive("tp", self.tp)
        _check_positive("pp", self.pp)
        self.sequence_parallel = str(self.sequence_parallel).lower()
        _check_choice("sequence_parallel", self.sequence_parallel, SEQUENCE_PARALLEL)
        for key in ("first_stage_layers", "last_stage_layers"):
            if getattr(self, key) is not None:
                _check_positive(key, getattr(self, key))
                if self.pp == 1:
                    raise ValueError(f"{key}={getattr(self, key)} needs pp > 1; set it to null")

    @property
    def use_sequence_parallel(self) -> bool:
        """Whether SP is on (it does nothing at tp == 1, so it is off there)."""
        return self.tp > 1 and self.sequence_parallel in ("auto", "true")


DTYPES = ("float32", "bfloat16")
LAYER_SPECS = ("auto", "local", "te")
RECOMPUTE_GRANULARITIES = ("full", "selective")


@dataclass(kw_only=True)
class ActorConfig:
    """The megatron actor: parallelism, precision, micro-batching, optimizer."""

    mb_spec: MicroBatchSpec
    optimizer: OptimizerConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    dtype: str = "float32"
    # Activation recomputation for long contexts: "full" reruns each layer's forward in
    # the backward (saves only layer inputs), "selective" only the attention core.
    recompute: bool = False
    recompute_granularity: str = "full"
    # Megatron throughput switches; the defaults are megatron's and AReaL's (all off).
    # Overlap the DP grad reduce-scatter with the backward, in buckets.
    overlap_grad_reduce: bool = False
    # Overlap the DistributedOptimizer's param all-gather with the next forward (needs
    # overlap_grad_reduce); the actor completes it before weights leave (sync, export).
    overlap_param_gather: bool = False
    # Fuse the weight-gradient GEMM with the accumulation into main_grad (TE / apex
    # kernels): "auto" = with the TransformerEngine spec on a GPU.
    gradient_accumulation_fusion: str = "auto"
    # Padded vocab = multiple of this x TP (megatron's make-vocab-size-divisible-by).
    vocab_divisible_by: int = 128
    # "auto": TransformerEngine's spec when TE imports with CUDA, else the local spec.
    layer_spec: str = "auto"
    # Fused vocab-parallel logprob (kernels/logprob.py): "auto" is Triton on GPU with
    # triton installed, the chunked torch path otherwise; both give the same numbers.
    logprob_kernel: str = "auto"

    def __post_init__(self):
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("layer_spec", self.layer_spec, LAYER_SPECS)
        _check_choice("logprob_kernel", self.logprob_kernel, KERNELS)
        _check_choice("recompute_granularity", self.recompute_granularity, RECOMPUTE_GRANULARITIES)
        self.gradient_accumulation_fusion = str(self.gradient_accumulation_fusion).lower()
        _check_choice("gradient_accumulation_fusion", self.gradient_accumulation_fusion, SEQUENCE_PARALLEL)
        if self.overlap_param_gather and not self.overlap_grad_reduce:
            raise ValueError("overlap_param_gather=true needs overlap_grad_reduce=true (megatron's rule)")
        _check_positive("vocab_divisible_by", self.vocab_divisible_by)


@dataclass(kw_only=True)
class TrainerConfig:
    """The RL loop's schedule."""

    total_steps: int
    batch_size: int  # prompts per step (each sampled rollout.n_samples times)
    save_freq: int = 0  # steps between checkpoints; 0: never
    eval_freq: int = 0  # steps between evaluations on eval_dataset (and before step 1); 0: never
    log_dir: str = "runs"  # the run writes under log_dir/experiment_name
    max_prompt_tokens: int = 1024  # longer prompts are dropped (and counted)
    # sync: every batch is sampled by the weights it trains; async: rollouts go on during
    # training, at most rollout.max_head_offpolicyness versions behind (pair it with
    # ppo.use_decoupled_loss).
    mode: str = "sync"
    export_freq: int = 0  # steps between HF exports to <run>/hf/step_N; the last step always
    tensorboard: bool = True  # scalars under <run>/tensorboard
    progress: bool = True  # tqdm bar over the steps
    dump_to_file: bool = False  # every rollout as JSONL under <run>/rollouts/
    trace: bool = False  # Chrome trace of the step phases: <run>/trace.json (chrome://tracing)
    # Weights & Biases beside TensorBoard (trainer/wandb_log.py); mode=disabled by default.
    wandb: WandbConfig = field(default_factory=WandbConfig)

    def __post_init__(self):
        _check_choice("mode", self.mode, TRAINER_MODES)
        _check_positive("export_freq", self.export_freq, allow_zero=True)
        _check_positive("total_steps", self.total_steps)
        _check_positive("batch_size", self.batch_size)
        _check_positive("save_freq", self.save_freq, allow_zero=True)
        _check_positive("eval_freq", self.eval_freq, allow_zero=True)
        _check_positive("max_prompt_tokens", self.max_prompt_tokens)


@dataclass(kw_only=True)
class SFTConfig:
    """Supervised warm-up (``areal-mcore sft``): base model -> HF folder at output_dir."""

    base_model: str  # HF folder to start from
    output_dir: str  # HF folder written at the end (the RL run's model_path)
    steps: int
    batch_size: int
    response_template: str = "The answer is {solution}."

    def __post_init__(self):
        _check_positive("steps", self.steps)
        _check_positive("batch_size", self.batch_size)
        if "{solution}" not in self.response_template:
            raise ValueError("response_template must contain {solution}")


@dataclass(kw_only=True)
class ExperimentConfig:
    """Root of every YAML file under configs/. Sections other than the actor's are
    optional so that tools needing only the actor (conversion) load the same files."""

    experiment_name: str
    seed: int = 1
    model_path: str | None = None  # HF folder: initial weights and the servers' model
    tokenizer_path: str | None = None  # None: model_path
    actor: ActorConfig
    ppo: PPOConfig = field(default_factory=PPOConfig)
    dataset: DatasetConfig | None = None
    eval_dataset: DatasetConfig | None = None  # held-out problems for trainer.eval_freq
    rollout: RolloutConfig | None = None
    server: ServerConfig | None = None
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    reward: RewardPoolConfig = field(default_factory=RewardPoolConfig)
    trainer: TrainerConfig | None = None
    sft: SFTConfig | None = None
    launch: LaunchConfig = field(default_factory=LaunchConfig)  # Slurm (launcher/slurm.py)
    plan: PlanConfig = field(default_factory=PlanConfig)  # memory planner (areal-mcore plan)

    def __post_init__(self):
        r, s = self.rollout, self.server
        if r is not None and s is not None and r.min_new_tokens > 0 and s.skip_tokenizer_init:
            # SGLang's raise_if_tokenizer_required: it needs the tokenizer's eos id to hold
            # EOS back, and a tokenizer-free server has none (the embedded server neither).
            raise ValueError(
                f"rollout.min_new_tokens={r.min_new_tokens} needs a tokenizer on the servers, "
                "but server.skip_tokenizer_init is true (SGLang refuses min_new_tokens there): "
                "set rollout.min_new_tokens=0, or server.skip_tokenizer_init=false with "
                "server.backend=sglang")
        if s is not None and s.backend == "vllm":
            from areal_mcore.rollout.engines.vllm import vllm_pause_mode

            vllm_pause_mode(self.weight_sync.pause_mode)  # vLLM has no retract
            if self.weight_sync.mode == "disk":
                raise ValueError("weight_sync.mode=disk is not wired for server.backend=vllm: "
                                 "use weight_sync.mode=distributed")
        if self.trainer is not None and self.rollout is not None and self.rollout.temperature <= 0:
            raise ValueError(f"rollout.temperature={self.rollout.temperature} must be > 0 for training: "
                             "the actor scores tokens at the sampling temperature")
        self._check_reward_groups()

    def _check_reward_groups(self) -> None:
        # Reward groups are the rollout's groups: one source of truth for their size.
        norm = self.ppo.reward_norm
        if norm is None or not norm.uses_groups:
            return
        n = self.rollout.n_samples if self.rollout is not None else None
        if norm.group_size is None:
            if n is None:
                raise ValueError("ppo.reward_norm.group_size is needed for 'group' levels when there is "
                                 "no rollout section (set it, or rollout.n_samples)")
            self.ppo.reward_norm = dataclasses.replace(norm, group_size=n)
        elif n is not None and norm.group_size != n:
            raise ValueError(
                f"ppo.reward_norm.group_size={norm.group_size} does not match rollout.n_samples={n}: "
                f"groups would mix prompts or split one; set ppo.reward_norm.group_size={n} or null "
                "(null follows rollout.n_samples)"
            )


# --------------------------------------------------------------------------- loading


def load_config(yaml_path: str | Path | None, overrides: list[str] | None = None,
                schema: type = ExperimentConfig):
    """Builds a typed config from a YAML file plus ``a.b.c=value`` overrides.

    Args:
        yaml_path: YAML file (or None for overrides only).
        overrides: ``dotted.key=value`` strings; values are parsed as YAML (``null``,
            ``1e-5``, ``[1,2]``), applied in order after the file.
        schema: the root dataclass.

    Returns:
        An instance of ``schema`` with every nested dataclass validated.

    Raises:
        ConfigError: unknown key (with the nearest valid keys), wrong type (with the
            expected type), missing required value, or a value its dataclass rejects.
    """
    cfg = OmegaConf.structured(schema)
    if yaml_path is not None:
        path = Path(yaml_path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            file_cfg = OmegaConf.load(path)
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: invalid YAML: {e}") from None
        if not isinstance(file_cfg, DictConfig):
            raise ConfigError(f"{path}: the top level must be a mapping of config keys")
        cfg = _merge(cfg, file_cfg, schema, lambda key: f"{path}:{_yaml_line(path, key)}")
    for item in overrides or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} must look like a.b.c=value")
        dot = OmegaConf.from_dotlist([f"{key.strip()}={value}"])
        cfg = _merge(cfg, dot, schema, lambda _k, item=item: f"override {item!r}")
    return _build(schema, cfg, "")


def _merge(cfg, other, schema: type, where) -> Any:
    try:
        return OmegaConf.merge(cfg, other)
    except ConfigKeyError as e:
        key = e.full_key
        raise ConfigError(f"{where(key)}: unknown config key {key!r}{_suggest(schema, key)}") from None
    except ValidationError as e:
        key = e.full_key
        expected = _type_name(_field_type(schema, key))
        got = OmegaConf.select(other, key, default=None)
        raise ConfigError(
            f"{where(key)}: config key {key!r} expects {expected}, got {got!r}"
        ) from None
    except OmegaConfBaseException as e:
        raise ConfigError(f"{where(getattr(e, 'full_key', ''))}: {e}") from None


def _build(cls: type, node: DictConfig, path: str):
    """Instantiates ``cls`` bottom-up so a ``__post_init__`` error gets its dotted path."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        sub = _dataclass_of(hints[f.name])
        if OmegaConf.is_missing(node, f.name):
            if sub is not None:  # a whole required section: name its first missing leaf
                _build(sub, OmegaConf.structured(sub), f"{path}{f.name}.")
            key = f"{path}{f.name}"
            raise ConfigError(
                f"missing required config value {key!r}: set it in the YAML file or with {key}=..."
            )
        value = node[f.name]
        if sub is not None and value is not None:
            value = _build(sub, value, f"{path}{f.name}.")
        elif isinstance(value, DictConfig | ListConfig):
            value = OmegaConf.to_container(value)
        kwargs[f.name] = value
    try:
        return cls(**kwargs)
    except ValueError as e:  # a dataclass's __post_init__ names the bare key
        raise ConfigError(f"{path}{e}") from None


def _all_keys(schema: type, prefix: str = "") -> list[str]:
    keys, hints = [], typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        full = f"{prefix}{f.name}"
        keys.append(full)
        sub = _dataclass_of(hints[f.name])
        if sub is not None:
            keys.extend(_all_keys(sub, full + "."))
    return keys


def _suggest(schema: type, key: str) -> str:
    """'; did you mean ...' with the nearest keys at the same level, else anywhere."""
    parent, _, leaf = key.rpartition(".")
    keys = _all_keys(schema)
    siblings = [k for k in keys if k.rpartition(".")[0] == parent]
    # Leaf names only: whole dotted keys share their prefix, which makes every sibling
    # look close ('actor.lrr' would suggest 'actor.dtype').
    by_sibling_leaf = {k.rpartition(".")[2]: k for k in siblings}
    close = [by_sibling_leaf[m] for m in difflib.get_close_matches(leaf, by_sibling_leaf, n=3, cutoff=0.6)]
    if not close:  # a key in the wrong section: match the leaf name anywhere
        by_leaf = {k.rpartition(".")[2]: k for k in keys}
        close = [by_leaf[m] for m in difflib.get_close_matches(leaf, by_leaf, n=3, cutoff=0.6)]
    if close:
        return "; did you mean " + " or ".join(repr(c) for c in close) + "?"
    return f"; valid keys here: {sorted(k.rpartition('.')[2] for k in siblings)}"


def _dataclass_of(tp: Any) -> type | None:
    """The dataclass inside ``tp`` (``X`` or ``Optional[X]``), if any."""
    candidates = typing.get_args(tp) or (tp,)
    for c in candidates:
        if dataclasses.is_dataclass(c):
            return c
    return None


def _field_type(schema: type, key: str) -> Any:
    tp: Any = schema
    for part in key.split("."):
        cls = _dataclass_of(tp)
        if cls is None:
            return None
        tp = typing.get_type_hints(cls).get(part)
    return tp


def _type_name(tp: Any) -> str:
    if tp is None:
        return "a value of the schema's type"
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args:
        inner = [a for a in args if a is not type(None)]
        return " or ".join(_type_name(a) for a in inner) + " or null"
    return getattr(tp, "__name__", str(tp))


def _yaml_line(path: Path, dotted: str) -> int:
    """1-based line of ``dotted`` (or its deepest existing parent) in a YAML file."""
    node = yaml.compose(path.read_text())
    line = 1
    for part in dotted.split("."):
        if not isinstance(node, yaml.MappingNode):
            break
        for key_node, value_node in node.value:
            if key_node.value == part:
                line = key_node.start_mark.line + 1
                node = value_node
                break
        else:
            break
    return line
