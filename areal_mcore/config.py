"""The root config schema and its loader: YAML + ``a.b.c=value`` -> typed dataclasses.

Each component's ``@dataclass(kw_only=True)`` config lives beside its component and
validates its own fields in ``__post_init__`` (raising ``checks.FieldError`` with the bare
field name); this module imports them into ``ExperimentConfig``, and nothing below it
imports this module. ``load_config(path, overrides)`` merges a YAML file and command-line overrides into the
dataclasses through OmegaConf structured configs. Unknown keys, wrong types and missing
required values raise :class:`ConfigError` naming the key, where it came from
(``file:line`` or the override) and the fix (nearest valid key, expected type).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
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

from areal_mcore.actor.config import ActorConfig
from areal_mcore.algo.config import PPOConfig
from areal_mcore.checks import FieldError
from areal_mcore.data.jsonl import DatasetConfig
from areal_mcore.doctor.config import DoctorConfig
from areal_mcore.eval.config import EvalConfig, FilterConfig
from areal_mcore.launcher.allocation import parse_allocation
from areal_mcore.launcher.config import LaunchConfig
from areal_mcore.plan.config import PlanConfig
from areal_mcore.reward.pool import RewardPoolConfig
from areal_mcore.rollout.config import RolloutConfig, ServerConfig
from areal_mcore.trainer.config import SFTConfig, TrainerConfig
from areal_mcore.weight_sync.config import WeightSyncConfig


class ConfigError(ValueError):
    """A config the user must fix; the message says where and how."""


@dataclass(kw_only=True)
class InferenceConfig:
    """The sections that say which model samples what, where and how its samples are scored,
    and the eval and filter commands' own sections. `areal-mcore eval` and `filter` read
    these (eval/config.py resolves what they take from them) and load this root alone when
    given no --config; ExperimentConfig adds the training sections."""

    model_path: str | None = None  # HF folder: initial weights and the servers' model
    tokenizer_path: str | None = None  # None: model_path
    dataset: DatasetConfig | None = None
    eval_dataset: DatasetConfig | None = None  # held-out problems for trainer.eval_freq
    rollout: RolloutConfig | None = None
    server: ServerConfig | None = None
    reward: RewardPoolConfig = field(default_factory=RewardPoolConfig)
    trainer: TrainerConfig | None = None
    eval: EvalConfig | None = None  # areal-mcore eval (not the run's periodic eval: rollout's sampling)
    filter: FilterConfig | None = None  # areal-mcore filter

    def __post_init__(self):
        if self.server is not None and self.server.model_path is None:
            # The servers serve the model trained or evaluated (the recipes say ${model_path}).
            self.server = dataclasses.replace(self.server, model_path=self.model_path)


@dataclass(kw_only=True)
class ExperimentConfig(InferenceConfig):
    """Root of every YAML file under configs/: InferenceConfig's sections and training's.
    Sections other than the actor's are optional so that tools needing only the actor
    (conversion) load the same files."""

    experiment_name: str
    seed: int = 1
    # A published algorithm's keys in one word (algo/presets.py): dapo, gspo, dr_grpo. Set
    # over the config file's values; key=value overrides still win.
    algo: str | None = None
    actor: ActorConfig
    ppo: PPOConfig = field(default_factory=PPOConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    sft: SFTConfig | None = None
    launch: LaunchConfig = field(default_factory=LaunchConfig)  # Slurm (launcher/slurm.py)
    plan: PlanConfig = field(default_factory=PlanConfig)  # memory planner (areal-mcore plan)
    doctor: DoctorConfig = field(default_factory=DoctorConfig)  # cluster preflight (areal-mcore doctor)

    def __post_init__(self):
        super().__post_init__()
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
        if self.trainer is not None and self.rollout is not None and self.rollout.temperature <= 0:
            raise ValueError(f"rollout.temperature={self.rollout.temperature} must be > 0 for training: "
                             "the actor scores tokens at the sampling temperature")
        if self.actor.router_replay and self.trainer is not None and not (s and s.return_routed_experts):
            raise ValueError("actor.router_replay=true needs server.return_routed_experts=true: the servers "
                             "return the experts to replay only when started with it")
        self._check_reward_groups()
        self._check_minibatches()
        self._resolve_loss_norm_tokens()
        self._check_overlong_penalty()
        self._check_allocation()
        self._resolve_drift_alarm()
        t = self.trainer
        if t is not None and t.max_rollout_logprob_gap is not None and not self.ppo.recomputes_prox:
            raise ValueError(
                f"trainer.max_rollout_logprob_gap={t.max_rollout_logprob_gap} needs "
                f"ppo.prox_logp_method recompute or metrics (it is {self.ppo.prox_logp_method!r}): the "
                "gap is measured against the recomputed proximal logprobs; set the method or the gap to null")

    def _resolve_drift_alarm(self) -> None:
        # On unless switched off: null picks the threshold by the dtypes on the two sides
        # of the gap (trainer/config.py DRIFT_GAP_BY_PRECISION). Only the recomputing
        # methods measure the gap; with another one a default stays off, a set value is refused below.
        from areal_mcore.trainer.config import DRIFT_GAP_BY_PRECISION

        t = self.trainer
        if t is None:
            return
        if not t.drift_alarm:
            self.trainer = dataclasses.replace(t, max_rollout_logprob_gap=None)
        elif t.max_rollout_logprob_gap is None and self.ppo.recomputes_prox:
            dtypes = {self.actor.dtype, self.weight_sync.dtype, *([self.server.dtype] if self.server else [])}
            gap = DRIFT_GAP_BY_PRECISION["float32" if dtypes == {"float32"} else "reduced"]
            self.trainer = dataclasses.replace(t, max_rollout_logprob_gap=gap)

    def _check_minibatches(self) -> None:
        # Each optimizer step takes a slice of the batch's samples: more minibatches than
        # samples would step on empty ones (it ran 936 steps on 64 samples, most on nothing).
        t, r, n = self.trainer, self.rollout, self.ppo.ppo_n_minibatches
        if t is None or r is None:
            return
        samples = t.batch_size * r.n_samples
        if n > samples:
            raise ValueError(f"ppo.ppo_n_minibatches={n} is more than a batch's {samples} samples "
                             f"(trainer.batch_size={t.batch_size} x rollout.n_samples={r.n_samples}): "
                             f"each optimizer step needs samples; set it to at most {samples}")

    def _resolve_loss_norm_tokens(self) -> None:
        # Dr.GRPO's constant normaliser defaults to the longest response the rollout allows.
        ppo = self.ppo
        if ppo.loss_agg_mode != "seq-mean-token-sum-norm" or ppo.loss_norm_tokens is not None:
            return
        if self.rollout is None:
            raise ValueError("ppo.loss_agg_mode='seq-mean-token-sum-norm' needs ppo.loss_norm_tokens "
                             "when there is no rollout section (null follows rollout.max_new_tokens)")
        self.ppo = dataclasses.replace(ppo, loss_norm_tokens=self.rollout.max_new_tokens)

    def _check_allocation(self) -> None:
        # The allocation decides which nodes and GPUs the rollout side gets, server.backend
        # which command runs there: they must name the same engine.
        launch, server = self.launch, self.server
        backend = server.backend if server is not None else "embedded"
        if launch.allocation is None:  # (c: a CP run's trainer takes cp GPUs)
            cp = f"c{self.actor.parallel.cp}" if self.actor.parallel.cp > 1 else ""
            derived = f"megatron:d1{cp}" if launch.stage == "sft" else f"{backend}:d1+megatron:d1{cp}"
            self.launch = dataclasses.replace(launch, allocation=derived)
            return
        alloc = parse_allocation(launch.allocation)
        p, trainer = self.actor.parallel, alloc.trainer
        if trainer.c != p.cp:
            # One CP size, stated twice: the allocation's c (how many GPUs the trainer gets,
            # and what the planner reads) and the actor's (how it splits each sequence). A
            # missing c is c1, so a CP run spells it in the allocation.
            # (e kept where it still divides d x c: EP is carved out of those ranks)
            fixed = dataclasses.replace(alloc, trainer=dataclasses.replace(
                trainer, c=p.cp, e=math.gcd(trainer.d * p.cp, trainer.e)))
            raise ValueError(
                f"launch.allocation={launch.allocation!r} has c{trainer.c} (context parallelism) but "
                f"actor.parallel.cp={p.cp}: they must agree; set launch.allocation={str(fixed)!r} "
                f"(c adds GPUs: {fixed.trainer.formula()}) or actor.parallel.cp={trainer.c}")
        if trainer.e != p.ep:
            # One EP size, stated twice: the allocation's e (which the planner's expert-DP and
            # the trainer's GPUs are read from; parse_allocation checked that it divides d x c)
            # and the actor's. A missing e is e1, so an EP run must spell it in the allocation.
            fixed = dataclasses.replace(alloc, trainer=dataclasses.replace(trainer, e=p.ep))
            fix = (f"launch.allocation={str(fixed)!r} or " if (trainer.d * trainer.c) % p.ep == 0 else
                   f"a launch.allocation whose {'d' if trainer.c == 1 else 'd x c'} is a multiple of {p.ep} "
                   f"(e{p.ep}), or ")
            raise ValueError(
                f"launch.allocation={launch.allocation!r} has e{trainer.e} (expert parallelism) but "
                f"actor.parallel.ep={p.ep}: they must agree; set {fix}actor.parallel.ep={trainer.e}")
        rollout = alloc.rollout
        if rollout is not None and server is not None and rollout.backend != server.backend:
            raise ValueError(
                f"launch.allocation={launch.allocation!r} places {rollout.backend!r} servers, but "
                f"server.backend={server.backend!r}: the allocation sizes the servers and server.backend "
                f"starts them; make them agree (e.g. launch.allocation="
                f"{str(dataclasses.replace(rollout, backend=server.backend))!r}+..., or "
                f"server.backend={rollout.backend})")

    def _check_overlong_penalty(self) -> None:
        # The penalty's length limit is the rollout's: one source of truth.
        pen = self.ppo.overlong_penalty
        if pen is None:
            return
        n = self.rollout.max_new_tokens if self.rollout is not None else None
        if pen.max_new_tokens is None:
            if n is None:
                raise ValueError("ppo.overlong_penalty.max_new_tokens is needed when there is no rollout "
                                 "section (set it, or rollout.max_new_tokens)")
            try:
                self.ppo.overlong_penalty = dataclasses.replace(pen, max_new_tokens=n)
            except FieldError as e:  # its own check, now that it knows the limit
                raise ValueError(e.at("ppo.overlong_penalty.")) from None
        elif n is not None and pen.max_new_tokens != n:
            raise ValueError(
                f"ppo.overlong_penalty.max_new_tokens={pen.max_new_tokens} does not match "
                f"rollout.max_new_tokens={n}: the penalty must reach its full size at the length "
                f"limit; set it to {n} or null (null follows rollout.max_new_tokens)")

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

    Paths (``model_path``, datasets, ``trainer.log_dir``) are not checked here: ``plan``,
    the Slurm launcher on a login node and ``eval`` load configs whose models and data
    exist only where the job runs, or are replaced by flags. ``trainer.ppo.train`` and
    ``trainer.sft.run_sft`` check them as the CLI does (``paths.check_run_paths``).
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
    cfg = _apply_overrides(cfg, overrides or [], schema)
    algo = cfg.get("algo") if "algo" in cfg else None
    if algo is not None:
        from areal_mcore.algo.presets import PRESETS, preset_tree

        if algo not in PRESETS:
            raise ConfigError(f"algo={algo!r} is not a preset: one of {sorted(PRESETS)}, or null "
                              "(docs/algorithm.md, Presets)")
        # Over the file's values; the command line's overrides are applied again and win.
        cfg = _merge(cfg, OmegaConf.create(preset_tree(algo)), schema, lambda key: f"algo={algo} preset ({key})")
        cfg = _apply_overrides(cfg, overrides or [], schema)
    return _build(schema, cfg, "")


def _apply_overrides(cfg, overrides: list[str], schema: type):
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} must look like a.b.c=value")
        dot = OmegaConf.from_dotlist([f"{key.strip()}={value}"])
        cfg = _merge(cfg, dot, schema, lambda _k, item=item: f"override {item!r}")
    return cfg


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
    except FieldError as e:  # names the key inside its dataclass: prefix the section's path
        raise ConfigError(e.at(path)) from None
    except ValueError as e:  # a check across sections (the root's) names its keys in full
        raise ConfigError(f"{path.rstrip('.')}: {e}" if path else str(e)) from None


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
        by_leaf: dict[str, list[str]] = {}  # a leaf may live in several sections: lr, seed
        for k in keys:
            by_leaf.setdefault(k.rpartition(".")[2], []).append(k)
        close = [k for m in difflib.get_close_matches(leaf, by_leaf, n=3, cutoff=0.6) for k in by_leaf[m]]
        section = key.partition(".")[0]
        close.sort(key=lambda k: k.partition(".")[0] != section)  # the typed section's first
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
    for part in key.replace("[", ".[").split("."):
        if part.startswith("["):  # an item of a list ('server.gpus[1]'): the list's element type
            lists = [a for a in typing.get_args(tp) or (tp,) if typing.get_origin(a) is list]
            tp = typing.get_args(lists[0])[0] if lists else None
            continue
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
