"""The run directory's protocol: the files the trainer writes and the launchers read.

One run lives in ``<trainer.log_dir>/<experiment_name>/``::

    STOP                    a request to checkpoint and exit (the launcher or a user touches it)
    stats.jsonl             one JSON row per finished step ({"step": N, ...})
    checkpoints/latest      the name of the newest complete checkpoint, e.g. step_00000042
    checkpoints/step_N/     one checkpoint (actor.checkpoint writes it)
    slurm/status.json       where a Slurm job is (launcher/slurm.py rewrites it)

A leaf (stdlib only), so the Slurm launcher reads a run without the training stack and
neither side keeps its own copy of a file name or format.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

LATEST = "latest"  # the checkpoint root's pointer file


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def checkpoint_step(path: str | Path) -> int:
    """The step of a checkpoint folder named by :func:`checkpoint_name`."""
    return int(Path(path).name.split("_")[-1])


def latest_checkpoint(root: str | Path) -> Path | None:
    """The folder ``root/latest`` names (it may be incomplete: the caller checks), or None."""
    pointer = Path(root) / LATEST
    return pointer.parent / pointer.read_text().strip() if pointer.is_file() else None


def point_latest_at(root: str | Path, name: str) -> None:
    """Atomically makes ``root/latest`` name ``name`` (write a sibling, rename over)."""
    write_atomic(Path(root) / LATEST, name)


def write_atomic(path: Path, text: str, *, fsync: bool = True) -> None:
    """Replaces ``path`` by renaming a finished sibling over it: readers see the old or the
    new content, never half of one."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


class RunDir:
    """One run's directory; every method is a file operation on it."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    @classmethod
    def of(cls, log_dir: str, experiment_name: str) -> RunDir:
        return cls(Path(log_dir) / experiment_name)

    @property
    def stats(self) -> Path:
        return self.path / "stats.jsonl"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def servers(self) -> Path:
        """Where the trainer's own rollout servers log."""
        return self.path / "servers"

    @property
    def slurm(self) -> Path:
        return self.path / "slurm"

    # ---- STOP ------------------------------------------------------------------------
    def request_stop(self) -> None:
        (self.path / "STOP").touch()

    def clear_stop(self) -> None:
        """Drops a request left for an earlier try."""
        (self.path / "STOP").unlink(missing_ok=True)

    def take_stop(self) -> bool:
        """Whether a stop was requested; the request is consumed, so the run that resumes
        after it goes on."""
        stop = self.path / "STOP"
        if not stop.exists():
            return False
        stop.unlink(missing_ok=True)
        return True

    # ---- stats rows ------------------------------------------------------------------
    def append_stats(self, row: dict) -> None:
        with open(self.stats, "a") as f:
            f.write(json.dumps(row) + "\n")

    def stats_rows(self) -> list[dict]:
        return read_jsonl(self.stats)

    def last_step(self) -> int:
        """The step of the last finished row (0 before the first)."""
        rows = self.stats_rows()
        return rows[-1]["step"] if rows else 0

    # ---- checkpoints -----------------------------------------------------------------
    def latest_checkpoint(self) -> Path | None:
        return latest_checkpoint(self.checkpoints)

    def checkpoint_step(self) -> int:
        """The step of the latest checkpoint (0 when there is none)."""
        path = self.latest_checkpoint()
        return checkpoint_step(path) if path else 0

    # ---- Slurm status ----------------------------------------------------------------
    def write_status(self, fields: dict) -> None:
        """``slurm/status.json``, replaced atomically (a reader never sees half of it)."""
        write_atomic(self.slurm / "status.json", json.dumps(fields, indent=2) + "\n", fsync=False)

    def read_status(self) -> dict:
        return json.loads((self.slurm / "status.json").read_text())


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


class Status:
    """A Slurm job's ``status.json``: fields kept in memory, the file rewritten on each change."""

    def __init__(self, run: RunDir, **fields):
        self.run, self.fields = run, fields

    def update(self, **fields) -> None:
        self.fields.update(fields, updated=time.strftime("%Y-%m-%dT%H:%M:%S"))
        self.run.write_status(self.fields)
