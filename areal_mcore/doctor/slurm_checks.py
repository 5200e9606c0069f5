"""The Slurm settings a long run depends on, read from ``scontrol`` on the batch node."""

from __future__ import annotations

import re
import subprocess

from areal_mcore.doctor.node import size
from areal_mcore.doctor.table import Check


def _scontrol(*args: str) -> str:
    return subprocess.run(["scontrol", *args], check=True, capture_output=True, text=True, timeout=30).stdout


def slurm_config() -> dict[str, str]:
    """``scontrol show config`` as key -> value ("KillWait" -> "30 sec")."""
    rows = (line.split("=", 1) for line in _scontrol("show", "config").splitlines() if " = " in line)
    return {k.strip(): v.strip() for k, v in rows}


def job_fields(job_id: str) -> dict[str, str]:
    return dict(kv.split("=", 1) for kv in _scontrol("show", "job", "-o", job_id).split() if "=" in kv)


def _seconds(text: str) -> float | None:
    """Slurm's [D-]HH:MM:SS, MM:SS or "30 sec" -> seconds; None for UNLIMITED."""
    text = text.strip()
    if text.upper() in ("UNLIMITED", "INFINITE", "NONE", ""):
        return None
    if m := re.fullmatch(r"(\d+)\s*sec", text):
        return float(m.group(1))
    days, _, clock = text.rpartition("-")
    parts = [float(p) for p in clock.split(":")]
    while len(parts) < 3:
        parts.insert(0, 0.0)
    return int(days or 0) * 86400 + parts[0] * 3600 + parts[1] * 60 + parts[2]


def slurm_checks(cfg, job: dict[str, str], config: dict[str, str], *, checkpoint_s: float,
                 checkpoint_from: str, gpus_expected: int) -> list[Check]:
    """``checkpoint_s``: how long the trainer needs after SIGTERM to checkpoint (``checkpoint_from``
    says whence: the run's own last steps, or the checkpoint's size over the measured write speed)."""
    launch, checks = cfg.launch, []
    kill_wait = _seconds(config.get("KillWait", "30 sec")) or 30.0
    checks.append(Check(
        "slurm.kill_wait", "pass" if kill_wait >= checkpoint_s else "fail", f"KillWait {kill_wait:.0f} s",
        f">= {checkpoint_s:.0f} s to checkpoint after SIGTERM ({checkpoint_from})",
        "raise KillWait in slurm.conf (and the partition's GraceTime for preemption): scancel and preemption "
        "SIGKILL the trainer mid-save, and the run loses the steps since its last checkpoint"))
    margin = launch.requeue_margin_s
    checks.append(Check(
        "slurm.requeue_margin", "pass" if margin > kill_wait else "fail", f"launch.requeue_margin_s {margin:.0f} s",
        f"> KillWait {kill_wait:.0f} s", f"set launch.requeue_margin_s > {kill_wait:.0f} (and launch.stop_lead_s "
        "above it): the requeue must finish before the time limit ends the job as TIMEOUT"))
    requeue = job.get("Requeue", "1") == "1"
    checks.append(Check("slurm.requeue", "pass" if requeue else "fail", f"Requeue={job.get('Requeue', '?')}",
                        "Requeue=1", "submit with --requeue (the sbatch headers have it): at the time limit the "
                        "launcher requeues the job, and Slurm refuses without it"))
    limit = _seconds(job.get("TimeLimit", "UNLIMITED"))
    if limit is None:
        checks.append(Check("slurm.time_limit", "pass", "unlimited", "> launch.stop_lead_s"))
    else:
        need = launch.stop_lead_s + checkpoint_s
        checks.append(Check("slurm.time_limit", "pass" if limit > need else "fail", f"{limit:.0f} s",
                            f"> {need:.0f} s (launch.stop_lead_s + one checkpoint)",
                            "ask for a longer --time: each try would stop before its first step"))
    gres = re.search(r"gres/gpu=(\d+)", job.get("TRES", "") or job.get("AllocTRES", ""))
    have = int(gres.group(1)) if gres else 0
    if gpus_expected:
        checks.append(Check("slurm.gres", "pass" if have >= gpus_expected else "fail", f"gres/gpu={have}",
                            f">= {gpus_expected} (launch.gpus_per_node x nodes)",
                            "submit with --gpus-per-node=<launch.gpus_per_node> (the sbatch headers have it)"))
    return checks


def checkpoint_seconds(files, checkpoint_bytes: int, write_bps: float | None) -> tuple[float, str]:
    """How long a checkpoint after SIGTERM takes: the slowest of the run's last steps' train
    phase and save (what the trainer finishes before it exits, docs/slurm_admin.md), else the
    checkpoint's size over the run directory's measured write speed."""
    rows = files.stats_tail(5)
    if rows:
        worst = max(r.get("time/train_s", 0.0) + r.get("time/save_s", 0.0) for r in rows)
        return worst, "the run's slowest recent train phase + save, stats.jsonl"
    if write_bps:
        return checkpoint_bytes / write_bps, f"{size(checkpoint_bytes)} at the measured {size(write_bps)}/s"
    return 0.0, "unknown"


