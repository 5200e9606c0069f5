"""srun steps ask for their share of a node's CPUs and memory (real local Slurm cluster)."""

from __future__ import annotations

import pytest
from _slurm import run, wait
from test_slurm_launch import _overrides, _sbatch, assets  # noqa: F401 - the module's fixture

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.server]


def test_srun_steps_run_with_their_gpus_share_of_cpus_and_memory(assets, tmp_path):  # noqa: F811
    # 2-CPU nodes, one "GPU" (process) per node, 4000 MB asked for the job on each node.
    job = _sbatch(_overrides(assets, tmp_path, "share", 1), tmp_path, "--mem=4000")
    assert wait(job, 300) == "COMPLETED", (tmp_path / f"slurm-{job}.out").read_text()[-3000:]
    rows = run("sacct", "-n", "-P", "-j", job, "-o", "JobName,AllocCPUS,ReqMem").splitlines()
    got = {name: (cpus, mem) for name, cpus, mem in (r.split("|") for r in rows if r)}
    assert got["rollout0"][0] == got["trainer"][0] == "2", got  # the node's CPUs / 1 GPU x 1
    # This cluster does not count memory (CR_Core: sacct shows no step memory), so the
    # flags are read from the launcher's log of each step's srun line.
    log = (tmp_path / f"slurm-{job}.out").read_text()
    for step in ("rollout0", "trainer"):
        line = next(x for x in log.splitlines() if x.startswith(f"[launcher] step {step}: srun "))
        assert " --exact --cpus-per-task=2 --mem=4000M" in line, line
