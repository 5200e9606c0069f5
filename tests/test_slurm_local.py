"""Smoke test of the real local Slurm cluster (scripts/slurm_local_up.sh).

A 2-node batch job runs one `srun` step on each node of its allocation; each step prints
SLURMD_NODENAME. The test waits for accounting (sacct) to report the job COMPLETED and
checks that both allocated nodes ran a step. Skipped where Slurm is not installed.
"""

import time

import pytest
from _slurm import require_cluster, run, wait

pytestmark = pytest.mark.slurm


def test_two_node_job_runs_a_step_on_each_node(tmp_path):
    require_cluster()

    out_file = tmp_path / "job.out"
    # The batch script records its allocation, then one step on each of its two nodes.
    script = 'echo "ALLOC $SLURM_JOB_NODELIST"; ' + "; ".join(
        f"srun --nodes=1 --ntasks=1 --relative={i} bash -c 'echo \"STEP $SLURMD_NODENAME\"'"
        for i in (0, 1)
    )
    job_id = (
        run(
            "sbatch",
            "--parsable",
            "--nodes=2",
            "--ntasks-per-node=1",
            "--time=5",
            "--job-name=pytest-slurm-local",
            f"--chdir={tmp_path}",
            f"--output={out_file}",
            f"--wrap={script}",
        )
        .strip()
        .split(";")[0]
    )

    state = wait(job_id, timeout_s=120)
    output = out_file.read_text() if out_file.exists() else "<no output file>"
    assert state == "COMPLETED", f"job {job_id} ended {state}; output:\n{output}"

    lines = [line.split() for line in output.splitlines()]
    alloc = [words[1] for words in lines if len(words) == 2 and words[0] == "ALLOC"]
    assert alloc, f"no allocation line in the job output:\n{output}"
    nodes = run("scontrol", "show", "hostnames", alloc[0]).split()
    assert len(nodes) == 2, f"job {job_id} was allocated {alloc[0]!r}, expected 2 nodes"
    stepped = [words[1] for words in lines if len(words) == 2 and words[0] == "STEP"]
    assert sorted(stepped) == sorted(nodes), (
        f"steps ran on {stepped}, expected one step on each of {nodes}:\n{output}"
    )

    # Both steps are in accounting too (records can trail the job's own by a moment).
    want = {f"{job_id}.0", f"{job_id}.1"}
    for _ in range(20):
        rows = run("sacct", "-n", "-P", "-j", job_id, "-o", "JobID,State").splitlines()
        steps = dict(row.split("|", 1) for row in rows if row)
        if all(steps.get(step) == "COMPLETED" for step in want):
            break
        time.sleep(0.5)
    assert all(steps.get(step) == "COMPLETED" for step in want), f"sacct steps: {steps}"
