"""``areal-mcore launch``: submit a run as a submitit job (or a job array for a sweep).

The job runs the same in-allocation launcher as the sbatch scripts (``launcher/slurm.py``)
in its batch step. Requeue uses submitit's ``Checkpointable``: on the time-limit or
preemption signal submitit calls ``checkpoint``, which asks the trainer to checkpoint
and waits for it, then submitit requeues the job, which resumes from that checkpoint.
"""

from __future__ import annotations

import itertools
import shlex
import sys
import time
from dataclasses import dataclass, field


class LaunchJob:
    """The submitted callable: the in-allocation launcher, returning the run's final stats."""

    def __init__(self, config: str, overrides: list[str], cwd: str):
        self.config, self.overrides, self.cwd = config, overrides, cwd
        self.launcher = None

    def __call__(self) -> dict:
        import os

        from areal_mcore.launcher.slurm import Launcher

        os.chdir(self.cwd)
        self.launcher = Launcher(self.config, self.overrides, requeue_self=False)
        code = self.launcher.run()
        run = self.launcher.files
        status = run.read_status()
        if code != 0:
            raise RuntimeError(f"the run failed ({status.get('error', f'exit code {code}')}); "
                               f"status {run.slurm / 'status.json'}")
        rows = run.stats_rows()
        return {"status": status, "last_step": rows[-1] if rows else None, "run_dir": str(run.path)}

    def checkpoint(self, *args, **kwargs):
        """submitit's hook on USR2 (time limit) or preemption: the trainer checkpoints and
        exits before submitit requeues this job."""
        import submitit

        if self.launcher is not None:
            self.launcher.stop_for_requeue()
        fresh = LaunchJob(self.config, self.overrides, self.cwd)
        return submitit.helpers.DelayedSubmission(fresh)


@dataclass(kw_only=True)
class SubmitConfig:
    config: str
    overrides: list[str] = field(default_factory=list)
    nodes: int = 1
    gpus_per_node: int = 8  # 0: CPU nodes (the embedded backend)
    partition: str | None = None
    time: str = "72:00:00"  # a try's limit, [D-]HH:MM:SS; the job requeues past it
    folder: str = "runs/submitit"  # submitit's own logs and pickles
    sweep: list[str] = field(default_factory=list)  # key=v1,v2 -> one array task per combination
    max_restarts: int = 3


def sweep_overrides(base: list[str], sweep: list[str], name: str) -> list[list[str]]:
    """Every combination of the ``key=v1,v2`` sweeps, each with its own experiment name."""
    if not sweep:
        return [base]
    axes = []
    for item in sweep:
        key, sep, values = item.partition("=")
        if not sep or not values:
            raise ValueError(f"--sweep {item!r} must be key=value1,value2")
        axes.append([(key, v) for v in values.split(",")])
    runs = []
    for combo in itertools.product(*axes):
        tag = "-".join(f"{k.rsplit('.', 1)[-1]}{v}" for k, v in combo)
        runs.append([*base, *(f"{k}={v}" for k, v in combo), f"experiment_name={name}-{tag}"])
    return runs


def _minutes(text: str) -> int:
    days, _, hms = text.rpartition("-")
    parts = [int(x) for x in hms.split(":")]
    while len(parts) < 3:
        parts.insert(0, 0)
    h, m, s = parts
    return (int(days or 0) * 24 + h) * 60 + m + (1 if s else 0)


def submit(cfg: SubmitConfig):
    """Submits the run(s); returns the submitit jobs."""
    import os

    from areal_mcore.config import load_config

    name = load_config(cfg.config, cfg.overrides).experiment_name  # config errors before submitting
    runs = sweep_overrides(cfg.overrides, cfg.sweep, name)
    for overrides in runs:
        load_config(cfg.config, overrides)
    ex = executor(cfg, name)
    jobs = [LaunchJob(cfg.config, o, os.getcwd()) for o in runs]
    if len(jobs) == 1:
        return [ex.submit(jobs[0])]
    return ex.submit_array(jobs)


def executor(cfg: SubmitConfig, name: str):
    """The submitit executor of ``cfg``'s jobs, named ``name``."""
    import submitit

    # exec: with use_srun=False the batch script runs submitit's command in bash
    # (submitit/slurm/slurm.py: _make_sbatch_string), and --signal=B:USR2 signals only the
    # batch shell (sbatch(1)). Bash's default action for USR2 is to exit, which ended the
    # job as FAILED at the time-limit warning, before submitit's handler could checkpoint
    # and requeue. Exec'd, the Python process is the batch shell and gets it, as the sbatch
    # scripts exec the launcher.
    ex = submitit.SlurmExecutor(folder=cfg.folder, max_num_timeout=cfg.max_restarts,
                                python=f"exec {shlex.quote(sys.executable)}")
    ex.update_parameters(
        job_name=name, nodes=1, ntasks_per_node=1, time=_minutes(cfg.time),
        # Whole nodes, as the sbatch headers ask: submitit writes only the options it is
        # given, and a node shared with the site's default CPUs (often 1 per task) leaves
        # the steps' --cpus-per-task unmet. --exclusive grants every CPU and GPU but only
        # the memory asked for; --mem=0 is all of it (sbatch(1)).
        exclusive=True, mem="0",
        use_srun=False,  # the launcher starts its own srun steps from the batch step
        # The node count goes to sbatch directly: submitit would otherwise wait for a result
        # from nodes x ntasks_per_node tasks, and the launcher is one process. USR2 goes
        # to the batch step only: torchrun (in the trainer step) has no handler for it.
        additional_parameters={"nodes": cfg.nodes, "signal": "B:USR2@300", "requeue": True},
        **({"partition": cfg.partition} if cfg.partition else {}),
        **({"gpus_per_node": cfg.gpus_per_node} if cfg.gpus_per_node else {}),
    )
    return ex


def wait(jobs, poll_s: float = 5.0) -> list[dict]:
    """Prints each job's state changes until all end; returns their results."""
    seen: dict[str, str] = {}
    while not all(j.done() for j in jobs):
        for j in jobs:
            state = j.state
            if seen.get(j.job_id) != state:
                seen[j.job_id] = state
                print(f"[launch] job {j.job_id}: {state}", flush=True)
        time.sleep(poll_s)
    return [j.result() for j in jobs]
