"""Helpers for tests against the real local Slurm cluster (scripts/slurm_local_up.sh)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from _tiers import needs

REPO = Path(__file__).resolve().parent.parent
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
            "BOOT_FAIL", "DEADLINE"}


def require(tool: str, what: str) -> None:
    """Skips without ``tool``, or fails under ``make test`` (AREAL_REQUIRE_SYSDEPS=1),
    which installs it: there a missing tool is a broken setup, not a reason to skip."""
    if shutil.which(tool) is None:
        message = f"{tool} not found: {what} (`make sysdeps` installs it)"
        if os.environ.get("AREAL_REQUIRE_SYSDEPS"):
            pytest.fail(message)
        pytest.skip(message)


def require_cluster() -> None:
    needs("slurm")
    require("sinfo", "the local Slurm cluster is not installed")
    ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=30)
    if "is UP" not in ping.stdout:
        pytest.fail(f"slurmctld does not answer ({ping.stdout.strip()} {ping.stderr.strip()}); "
                    "start the local cluster with `bash scripts/slurm_local_up.sh`")


def run(*cmd: str, **kw) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=60, **kw).stdout


def state(job_id: str) -> str:
    """The allocation's state in accounting ("CANCELLED by 0" -> "CANCELLED")."""
    out = run("sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State").split()
    return out[0] if out else ""


def steps(job_id: str) -> dict[str, tuple[str, str]]:
    """Step name -> (state, node list) of the job's latest try."""
    rows = run("sacct", "-n", "-P", "-j", job_id, "-o", "JobName,State,NodeList").splitlines()
    return {name: (st.split()[0], nodes) for name, st, nodes in (r.split("|") for r in rows if r)}


def wait(job_id: str, timeout_s: float, until=lambda st: st in TERMINAL) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        st = state(job_id)
        if until(st):
            return st
        time.sleep(1)
    info = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout
    # A job pending for Resources: which jobs hold them (an earlier test's, requeued?).
    queue = subprocess.run(["squeue", "-o", "%i %T %r %M %j %N"], capture_output=True, text=True).stdout
    subprocess.run(["scancel", job_id], capture_output=True)
    pytest.fail(f"job {job_id} still {state(job_id)!r} after {timeout_s:.0f} s:\n{info}\nsqueue:\n{queue}")
