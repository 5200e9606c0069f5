"""``ExperimentConfig`` -> the memory plan, its verdict and the fixes that would make it fit.

The config is read as a run would use it: the trainer's TP/PP/CP from ``actor.parallel``, its
DP from ``launch.allocation`` (the Slurm recipes set it; 1 otherwise, the conservative
case: nothing sharded), the servers from ``server`` and ``rollout``.

A micro-batch must hold every sequence: its packed row holds ``max_tokens_per_mb`` x cp
tokens (``MegatronActor._mb_budget``), and the allocator refuses a longer sequence when it
arrives, mid-run. A truncated response (``rollout.max_new_tokens``, which long-tailed
responses reach: 3.4 % of boba's) after a one-token prompt is sure to come, so a row
shorter than that does not fit; a row shorter than the longest possible sequence
(``trainer.max_prompt_tokens`` + ``max_new_tokens``, a bound the prompts seldom reach) is
warned about. Either way the fixes hold it: a larger cap, or more CP.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from areal_mcore.algo.presets import describe
from areal_mcore.launcher.allocation import parse_allocation
from areal_mcore.model.args import ModelArgs, padded_vocab_size
from areal_mcore.plan.architectures import resolve_architecture
from areal_mcore.plan.concurrency import concurrency
from areal_mcore.plan.lengths import boba_lengths, dump_lengths
from areal_mcore.plan.memory import (
    GiB,
    RankPlan,
    ServerShape,
    TrainerShape,
    server_plan,
    trainer_plan,
)
from areal_mcore.weight_sync.buckets import sync_memory_bytes

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
MAX_CP = 16  # the largest context parallelism a fix proposes


@dataclass
class Plan:
    architecture: str
    gpu_bytes: float
    dp: int
    trainer: list[RankPlan]
    server: dict | None
    fixes: list[dict] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    algorithm: str | None = None  # the algo preset's keys as resolved (algo/presets.py)
    cp: int = 1
    longest: int = 0  # the longest possible sequence, padded as the actor pads it (0: unknown, SFT)
    truncated: int = 0  # a truncated response after a one-token prompt, padded: sure to come
    row_tokens: int = 0  # tokens of the packed row a micro-batch holds: max_tokens_per_mb x cp

    @property
    def peak(self) -> RankPlan:
        return max(self.trainer, key=lambda r: r.total)

    @property
    def sequence_fits(self) -> bool:
        """Whether a micro-batch holds the longest possible sequence."""
        return self.longest <= self.row_tokens

    @property
    def trainer_fits(self) -> bool:
        """The peak rank fits, and a micro-batch holds a truncated response (module docstring)."""
        return self.peak.total <= self.gpu_bytes and self.truncated <= self.row_tokens

    @property
    def fits(self) -> bool:
        return self.trainer_fits and (self.server is None or self.server["fits"])


def trainer_dp(cfg) -> int:
    """DP of the trainer from launch.allocation, when it describes this actor's TP x PP x CP."""
    alloc = parse_allocation(cfg.launch.allocation)
    p = cfg.actor.parallel
    if (alloc.trainer.t, alloc.trainer.p, alloc.trainer.c) == (p.tp, p.pp, p.cp):
        return alloc.trainer.d
    return 1


def sequence_bounds(cfg) -> tuple[int, int]:
    """(the longest possible sequence: max_prompt_tokens + max_new_tokens; a truncated
    response after a one-token prompt), padded as the actor pads each sequence (to a
    multiple of TP under sequence parallelism, of 2·cp under CP: ``MegatronActor._aligned``);
    (0, 0) without a rollout (SFT: its lengths are the data's)."""
    if cfg.rollout is None:
        return 0, 0
    p = cfg.actor.parallel
    m = (p.tp if p.use_sequence_parallel else 1) * (2 * p.cp if p.cp > 1 else 1)
    new = cfg.rollout.max_new_tokens
    return (_round_up((cfg.trainer.max_prompt_tokens if cfg.trainer else 1) + new, m), _round_up(1 + new, m))


def trainer_shape(cfg, gpu_bytes: float, args: ModelArgs) -> TrainerShape:
    a, p = cfg.actor, cfg.actor.parallel
    sync = sync_memory_bytes(
        args, bucket_bytes=int(cfg.weight_sync.bucket_mb * 2**20), dtype_bytes=_DTYPE_BYTES[cfg.weight_sync.dtype],
        actor_dtype_bytes=_DTYPE_BYTES[a.dtype], tp=p.tp, ep=p.ep,
        padded_vocab=padded_vocab_size(args.vocab_size, p.tp, a.vocab_divisible_by)) if cfg.rollout is not None else 0
    return TrainerShape(
        tp=p.tp, pp=p.pp, dp=trainer_dp(cfg), ep=p.ep, cp=p.cp, sequence_parallel=p.use_sequence_parallel,
        recompute=a.recompute, recompute_granularity=a.recompute_granularity,
        first_stage_layers=p.first_stage_layers, last_stage_layers=p.last_stage_layers,
        tokens_per_mb=a.mb_spec.max_tokens_per_mb, dtype_bytes=_DTYPE_BYTES[a.dtype],
        path="local" if a.layer_spec == "local" else "te", vocab_divisible_by=a.vocab_divisible_by,
        weight_sync_bytes=int(sync), margin_bytes=int(cfg.plan.margin_gb * GiB),
        reference_model=cfg.ppo.uses_reference)


def server_shape(cfg, gpu_bytes: float) -> ServerShape | None:
    if cfg.rollout is None or cfg.server is None or cfg.server.backend == "embedded":
        return None  # the embedded server runs on CPU: no GPU memory to plan
    # vLLM's --gpu-memory-utilization (rollout/engines/vllm.py passes mem_fraction_static) is,
    # like SGLang's, the share of the GPU for weights + KV cache: one model for both.
    r, s = cfg.rollout, cfg.server
    prompt = cfg.trainer.max_prompt_tokens if cfg.trainer else 0
    # The Slurm launcher starts launch.allocation's rollout side (d servers of TP t) and
    # overrides server.tp_size with it; elsewhere server.n_servers / tp_size hold.
    side = parse_allocation(cfg.launch.allocation).rollout
    n, tp = (side.d, side.t) if side is not None and side.backend != "embedded" else (s.n_servers, s.tp_size)
    return ServerShape(tp=tp, n_servers=n, mem_fraction_static=s.mem_fraction_static,
                       gpu_bytes=gpu_bytes, sequence_tokens=min(s.context_length, prompt + r.max_new_tokens),
                       concurrent_sequences=r.max_concurrent_rollouts * r.n_samples,
                       dtype_bytes=_DTYPE_BYTES[s.dtype])


def make_plan(cfg, gpu_memory_gb: float | None = None, *, with_fixes: bool = True) -> Plan:
    """The plan of ``cfg`` on GPUs of ``gpu_memory_gb`` (default: plan.gpu_memory_gb)."""
    gpu_bytes = (gpu_memory_gb or cfg.plan.gpu_memory_gb) * GiB
    args, source = resolve_architecture(cfg.model_path, cfg.plan.architecture)
    shape = server_shape(cfg, gpu_bytes)
    plan = Plan(architecture=source, gpu_bytes=gpu_bytes, dp=trainer_dp(cfg),
                trainer=trainer_plan(args, trainer_shape(cfg, gpu_bytes, args)),
                server=server_plan(args, shape) if shape else None, cp=cfg.actor.parallel.cp,
                row_tokens=cfg.actor.mb_spec.max_tokens_per_mb * cfg.actor.parallel.cp)
    plan.longest, plan.truncated = sequence_bounds(cfg)
    if plan.server is not None:
        plan.server.update(rollout_concurrency(cfg, plan.server))
        # Judged at expected lengths: the engine admits by KV and retracts on overrun, so
        # the worst case (sequences_fit, every sequence at the full length) is reported only.
        plan.server["fits"] = plan.server["kv_pool_per_gpu"] > 0 and plan.server["fits_expected"]
    if with_fixes and not (plan.fits and plan.sequence_fits):
        plan.fixes = fixes(cfg, args, plan, gpu_memory_gb)
    plan.warnings = [w for w in (allocation_disagreement(cfg), _long_prompt_warning(plan)) if w]
    plan.algorithm = describe(cfg)
    return plan


def allocation_disagreement(cfg) -> str | None:
    """What is wrong when ``actor.parallel`` and ``launch.allocation``'s trainer disagree on
    TP/PP (an override of one but not the other): the plan cannot read DP from the
    allocation, and the Slurm launcher passes the allocation's t and p to the trainer
    (launcher/slurm.py), so the run would not be the one planned. (CP cannot disagree:
    config loading requires the allocation's c to equal actor.parallel.cp.)"""
    alloc, p = parse_allocation(cfg.launch.allocation), cfg.actor.parallel
    t = alloc.trainer
    if (t.t, t.p) == (p.tp, p.pp):
        return None
    fix = _allocation_at(alloc, p.tp, p.pp)
    return (f"launch.allocation={cfg.launch.allocation} gives the trainer t{t.t} p{t.p}, but actor.parallel is "
            f"tp={p.tp} pp={p.pp}: planned at DP 1 (nothing sharded), and the Slurm launcher would run "
            f"t{t.t} p{t.p}; "
            + (f"set launch.allocation={fix} (its {t.gpus} trainer GPUs at tp={p.tp} pp={p.pp})" if fix else
               f"its {t.gpus} trainer GPUs do not tile at tp={p.tp} pp={p.pp}: change launch.allocation to match"))


def _long_prompt_warning(plan: Plan) -> str | None:
    """The row holds a truncated response but not the longest possible sequence."""
    if plan.sequence_fits or plan.truncated > plan.row_tokens:
        return None
    return (f"a sequence of trainer.max_prompt_tokens + rollout.max_new_tokens ({plan.longest} tokens, padded) "
            f"does not fit a micro-batch (max_tokens_per_mb x cp = {plan.row_tokens}): the allocator refuses "
            f"such a sample when it arrives; see the fixes below")


def _allocation_at(alloc, tp: int, pp: int) -> str | None:
    """``alloc`` with its trainer's GPUs at ``tp`` x ``pp`` and its own c (DP takes the
    rest); None where they do not tile, or EP (carved out of DP x CP) no longer divides
    DP x CP."""
    t = alloc.trainer
    if t.gpus % (tp * pp * t.c) or (t.gpus // (tp * pp)) % t.e:
        return None
    trainer = dataclasses.replace(t, d=t.gpus // (tp * pp * t.c), t=tp, p=pp)
    return str(dataclasses.replace(alloc, trainer=trainer))


def rollout_concurrency(cfg, server: dict) -> dict:
    """``plan/concurrency.py`` on this config's servers, lengths and trainer batch."""
    r, t = cfg.rollout, cfg.trainer
    lengths = (boba_lengths(r.max_new_tokens) if cfg.plan.lengths is None
               else dump_lengths(cfg.plan.lengths, r.max_new_tokens))
    return concurrency(lengths=lengths, prompt_tokens=t.max_prompt_tokens if t else 0,
                       kv_tokens=server["kv_tokens"], headroom=cfg.plan.kv_headroom,
                       n_servers=server["n_servers"], n_samples=r.n_samples,
                       max_running_requests=cfg.server.max_running_requests,
                       configured_groups=r.max_concurrent_rollouts,
                       batch_size=t.batch_size if t is not None and t.mode == "async" else None,
                       max_head_offpolicyness=r.max_head_offpolicyness)


def _replace(cfg, dotted: str, value):
    """``cfg`` with one dotted key changed (the nested dataclasses re-validate)."""
    head, _, rest = dotted.partition(".")
    inner = _replace(getattr(cfg, head), rest, value) if rest else value
    return dataclasses.replace(cfg, **{head: inner})


def _candidates(cfg, args: ModelArgs, plan: Plan) -> list[tuple[str, list[tuple[str, object]]]]:
    """(part fixed: "trainer" | "server", overrides) for every knob worth trying."""
    a, p = cfg.actor, cfg.actor.parallel
    out: list[tuple[str, list[tuple[str, object]]]] = []
    if not plan.trainer_fits or not plan.sequence_fits:
        if not a.recompute:
            out.append(("trainer", [("actor.recompute", True)]))
        if p.tp > 1 and not p.use_sequence_parallel:
            out.append(("trainer", [("actor.parallel.sequence_parallel", "true")]))
            if not a.recompute:
                out.append(("trainer", [("actor.recompute", True), ("actor.parallel.sequence_parallel", "true")]))
        longest, cap = plan.longest, a.mb_spec.max_tokens_per_mb
        if not plan.sequence_fits:  # the least cap that holds it (more activations: with recompute too)
            need = [("actor.mb_spec.max_tokens_per_mb", _round_up(-(-longest // p.cp), 1024))]
            out.append(("trainer", need))
            if not a.recompute:
                out.append(("trainer", [("actor.recompute", True), *need]))
        cap //= 2
        while cap * p.cp >= longest and cap >= 1024:  # a micro-batch must hold the longest sequence
            out.append(("trainer", [("actor.mb_spec.max_tokens_per_mb", cap)]))
            cap //= 2
        # More CP: each rank holds 1/cp of the row, whose budget stays (or grows to the longest
        # sequence); fixes() keeps the smallest cp that fits and drops the larger ones.
        row = max(a.mb_spec.max_tokens_per_mb * p.cp, longest)
        cp = 2 * p.cp
        while cp <= MAX_CP and -(-row // cp) >= 1024:
            out.append(("trainer", [("actor.parallel.cp", cp),
                                    ("actor.mb_spec.max_tokens_per_mb", _round_up(-(-row // cp), 128))]))
            cp *= 2
        if args.num_layers % (2 * p.pp) == 0:
            out.append(("trainer", [("actor.parallel.pp", 2 * p.pp)]))
        if 2 * p.tp <= 8 and args.num_kv_heads % (2 * p.tp) == 0:
            out.append(("trainer", [("actor.parallel.tp", 2 * p.tp)]))
        if args.num_experts and args.num_experts % (2 * p.ep) == 0:
            out.append(("trainer", [("actor.parallel.ep", 2 * p.ep)]))  # fewer experts per rank
    s = plan.server
    if s is not None and not s["fits"]:
        groups = s["sequences_fit_expected"] * s["n_servers"] // cfg.rollout.n_samples
        if groups >= 1:
            out.append(("server", [("rollout.max_concurrent_rollouts", groups)]))
        if 2 * s["tp"] <= 8 and parse_allocation(cfg.launch.allocation).rollout is None:
            out.append(("server", [("server.tp_size", 2 * s["tp"])]))
    return out


def fixes(cfg, args: ModelArgs, plan: Plan, gpu_memory_gb: float | None) -> list[dict]:
    """Each candidate change with its predicted trainer peak and whether the part it
    addresses (trainer or rollout server) then fits.

    TP/PP changes keep the trainer's GPU count, so DP shrinks with them (launch.allocation
    is rewritten to match); an EP change rewrites the allocation's e (EP is carved out of
    DP: the GPUs stay); a CP change rewrites the allocation's c with it (config loading
    requires them equal) and keeps the trainer's GPUs where d divides by the factor (d
    shrinks, DP x CP and so the optimizer's shard stay), else adds GPUs (c multiplies them)
    and says so; of the CP candidates only those up to the smallest that fits are kept.
    The other knobs leave the allocation as it is."""
    out, cp_fits = [], False
    for part, change in _candidates(cfg, args, plan):
        keys = dict(change)
        note = None
        if "actor.parallel.ep" in keys:
            new = _with_ep(cfg, keys["actor.parallel.ep"])
            if new is None:
                continue
        elif "actor.parallel.cp" in keys:
            if cp_fits:
                continue
            new, note = _with_cp(cfg, keys["actor.parallel.cp"], keys["actor.mb_spec.max_tokens_per_mb"])
            if new is None:
                continue
        else:
            new = cfg
            for key, value in change:
                new = _replace(new, key, value)
        if any(k in ("actor.parallel.tp", "actor.parallel.pp") for k, _ in change):
            new = _rescale_allocation(cfg, new)
            if new is None:
                continue
        try:
            after = make_plan(new, gpu_memory_gb, with_fixes=False)
        except ValueError:
            continue
        fits = (after.trainer_fits and after.sequence_fits if part == "trainer"
                else bool(after.server and after.server["fits"]))
        cp_fits = cp_fits or ("actor.parallel.cp" in keys and fits)
        out.append({"overrides": [f"{k}={_yaml(v)}" for k, v in change]
                    + ([f"launch.allocation={new.launch.allocation}"]
                       if new.launch.allocation != cfg.launch.allocation else []),
                    "part": part, "trainer_peak_gib": round(after.peak.total / GiB, 1),
                    "fits": fits, "all_fit": after.fits, **({"note": note} if note else {})})
    return out


def _with_cp(cfg, cp: int, max_tokens_per_mb: int):
    """(``cfg`` at context parallelism ``cp`` with ``max_tokens_per_mb``, the allocation's c
    with it, and what that does to the trainer's GPUs), or (None, None) where the config
    refuses it. The GPUs stay where the allocation's d divides by the factor (d shrinks,
    so DP x CP, the optimizer's shard, stays); else d stays and c adds GPUs."""
    alloc = parse_allocation(cfg.launch.allocation)
    t, factor = alloc.trainer, cp // cfg.actor.parallel.cp
    if t.d % factor == 0:
        trainer = dataclasses.replace(t, d=t.d // factor, c=cp)
        note = (f"the trainer keeps its {t.gpus} GPUs: DP {t.d} -> {trainer.d} x CP {cp}, each rank holding "
                f"1/{cp} of every sequence")
    else:
        trainer = dataclasses.replace(t, c=cp)
        note = (f"the trainer needs {trainer.gpus} GPUs (was {t.gpus}): c{cp} multiplies them, DP {t.d} "
                f"cannot shrink by {factor}")
    try:
        new = dataclasses.replace(
            cfg, actor=_replace(_replace(cfg.actor, "parallel.cp", cp), "mb_spec.max_tokens_per_mb", max_tokens_per_mb),
            launch=dataclasses.replace(cfg.launch, allocation=str(dataclasses.replace(alloc, trainer=trainer))))
    except ValueError:
        return None, None
    return new, note


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _with_ep(cfg, ep: int):
    """``cfg`` at expert parallelism ``ep``, the allocation's e with it (config loading
    requires them equal, so both change at once); None where ep cannot divide the
    allocation's d x c or the config refuses it (the distributed weight sync at ep > 1)."""
    alloc = parse_allocation(cfg.launch.allocation)
    if (alloc.trainer.d * alloc.trainer.c) % ep:
        return None
    trainer = dataclasses.replace(alloc.trainer, e=ep)
    try:
        return dataclasses.replace(
            cfg, actor=_replace(cfg.actor, "parallel.ep", ep),
            launch=dataclasses.replace(cfg.launch, allocation=str(dataclasses.replace(alloc, trainer=trainer))))
    except ValueError:
        return None


def _rescale_allocation(old, new):
    alloc = parse_allocation(old.launch.allocation)
    t, p = alloc.trainer, old.actor.parallel
    if (t.t, t.p) != (p.tp, p.pp):
        return new  # DP unknown (1) either way
    text = _allocation_at(alloc, new.actor.parallel.tp, new.actor.parallel.pp)
    return None if text is None else _replace(new, "launch.allocation", text)


def _yaml(v) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)
