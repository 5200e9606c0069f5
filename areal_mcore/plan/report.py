"""The plan as a table, as JSON, and as the pre-start check of train/sft/the launcher."""

from __future__ import annotations

from areal_mcore.plan.memory import GiB
from areal_mcore.plan.planner import Plan, make_plan

_TERMS = ("weights", "ref_weights", "grads", "main_params", "optimizer", "activations", "logits_grad",
          "weight_sync", "margin")


def _gib(x: float) -> str:
    return f"{x / GiB:.1f}"


def format_table(plan: Plan) -> str:
    """Trainer terms per pipeline stage, the rollout server, the verdict and any fixes."""
    gpu = _gib(plan.gpu_bytes)
    lines = [f"memory plan per GPU (GiB) on {gpu} GiB GPUs; architecture from {plan.architecture}; "
             f"trainer DP {plan.dp}" + (f" x CP {plan.cp}" if plan.cp > 1 else "")]
    lines += [f"warning: {w}" for w in plan.warnings]
    if plan.algorithm:
        lines.append(plan.algorithm)
    head = ["rank"] + list(_TERMS) + ["total", "fits"]
    rows = [[r.where] + [_gib(r.terms[t]) for t in _TERMS] + [_gib(r.total), "yes" if r.total <= plan.gpu_bytes else "NO"]
            for r in plan.trainer]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    for row in [head] + rows:
        lines.append("  ".join(str(x).rjust(w) if i else str(x).ljust(w) for i, (x, w) in enumerate(zip(row, widths))))
    peak = plan.peak
    lines.append(f"peak trainer rank: {peak.where}, {_gib(peak.total)} GiB "
                 f"({peak.notes.get('activations', '')}; {peak.notes.get('weights', '')})")
    if plan.longest:
        row = f"max_tokens_per_mb x cp = {plan.row_tokens // plan.cp} x {plan.cp} = {plan.row_tokens}"
        if plan.sequence_fits:
            lines.append(f"longest sequence {plan.longest} tokens (max_prompt_tokens + max_new_tokens, padded): "
                         f"a micro-batch holds it ({row})")
        elif plan.truncated > plan.row_tokens:
            lines.append(f"a truncated response alone ({plan.truncated} tokens with a one-token prompt, padded) "
                         f"does NOT fit a micro-batch ({row} tokens; the allocator refuses it when it arrives)")
    s = plan.server
    if s is not None:
        lines.append(f"rollout server (per GPU): weights {_gib(s['weights_per_gpu'])}, KV pool "
                     f"{_gib(s['kv_pool_per_gpu'])} = {s['kv_tokens']} tokens "
                     f"({s['kv_bytes_per_token'] // 1024} KiB/token); {s['sequences_fit']} sequences of "
                     f"the full length fit (worst case), {s['sequences_configured']} configured per server")
        stale = ("" if s["expected_staleness"] is None else
                 f"; expected staleness {s['expected_staleness']:.2f} steps (bound {s['staleness_bound']})")
        lines.append(f"rollout concurrency at expected lengths ({s['lengths']}; mean {s['mean_length']:.0f} "
                     f"tokens, {s['slot_kv_tokens']:.0f} KV tokens per busy slot): {s['sequences_fit_expected']} "
                     f"sequences per server fit, max_running_requests {s['max_running_requests']} -> "
                     f"rollout.max_concurrent_rollouts={s['recommended_groups']}; configured: "
                     f"{s['occupancy_per_server']:.1f} sequences per server{stale}: "
                     f"{'fits' if s['fits'] else 'does NOT fit'}")
    lines.append("verdict: " + ("fits" if plan.fits else "does NOT fit") + f" in {gpu} GiB per GPU")
    for fix in plan.fixes:
        what = (f"trainer peak {fix['trainer_peak_gib']} GiB" if fix["part"] == "trainer"
                else "rollout server")
        lines.append(f"  fix ({fix['part']}): {' '.join(fix['overrides'])} -> {what}, "
                     + ("fits" if fix["fits"] else "not enough alone")
                     + (f" ({fix['note']})" if fix.get("note") else ""))
    return "\n".join(lines)


def to_json(plan: Plan) -> dict:
    return {
        "architecture": plan.architecture, "gpu_memory_gib": plan.gpu_bytes / GiB, "trainer_dp": plan.dp,
        "trainer_cp": plan.cp, "longest_sequence": plan.longest, "truncated_sequence": plan.truncated,
        "micro_batch_row_tokens": plan.row_tokens, "sequence_fits": plan.sequence_fits,
        "trainer": [{"rank": r.where, **{f"{k}_gib": v / GiB for k, v in r.terms.items()},
                     "total_gib": r.total / GiB, "fits": r.total <= plan.gpu_bytes, "notes": r.notes}
                    for r in plan.trainer],
        "peak_rank": plan.peak.where, "peak_gib": plan.peak.total / GiB,
        "server": None if plan.server is None else {
            k: (v / GiB if k in ("weights_per_gpu", "kv_pool_per_gpu") else v) for k, v in plan.server.items()},
        "fits": plan.fits, "fixes": plan.fixes, "warnings": plan.warnings,
        "algorithm": plan.algorithm,
    }


def refusal(cfg) -> str | None:
    """Why ``cfg`` must not start (the table and the fixes), or None when it fits or when
    ``plan.check`` is off. A config whose architecture cannot be found is not refused here
    (the run reports the missing model itself)."""
    if not cfg.plan.check:
        return None
    try:
        plan = make_plan(cfg)
    except (ValueError, FileNotFoundError):
        return None
    if plan.fits:
        return None
    return (format_table(plan) + "\nrefusing to start: this config does not fit in GPU memory; apply a fix "
            "above, or set plan.gpu_memory_gb for your GPUs, or pass --no-plan-check to start anyway")
