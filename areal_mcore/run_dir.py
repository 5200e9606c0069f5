"""The run directory's protocol: the files the trainer writes and the launchers read.

One run lives in ``<trainer.log_dir>/<experiment_name>/``::

    .lock                   held (lockf) by the run's trainer: one trainer per run directory
    STOP                    a request to checkpoint and exit (the launcher or a user touches it)
    stats.jsonl             one JSON row per finished step ({"step": N, ...})
    checkpoints/latest      the name of the newest complete checkpoint, e.g. step_00000042
    checkpoints/step_N/     one checkpoint (actor.checkpoint writes it)
    slurm/status.json       where a Slurm job is (launcher/slurm.py rewrites it)
    rollout_api_key         the key this run's rollout servers require (mode 0600; a new one
                            each launch: rollout/auth.py, docs/rollout.md#security)

A leaf (stdlib only), so the Slurm launcher reads a run without the training stack and
neither side keeps its own copy of a file name or format.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import sys
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


def new_key() -> str:
    """256 random bits in hex. Not ``token_urlsafe``: its keys start with "-" one time in
    64, which argparse takes for an option (SGLang's --config merge hands the key to its
    parser as ``--api-key KEY``: srt/utils/server_args_config_parser.py)."""
    return secrets.token_hex(32)


def write_private(path: Path, text: str) -> None:
    """Replaces ``path`` atomically by a file only its owner may read or write: created
    0600 (never world-readable for a moment, whatever the umask), then renamed over."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


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


# --------------------------------------------------------------------------- checkpoint files


def _hash_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _shared_files(root: Path, rank: int, world: int) -> list[Path]:
    """``root``'s files but the manifest, sorted; every ``world``-th from ``rank``."""
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.name != "manifest.json")
    return files[rank::world]


def hash_files(root: Path, rank: int, world: int) -> dict[str, dict]:
    """Size and SHA-256 of this rank's share of the files (torch.load checks no CRC, and
    a flipped byte in a tensor file loads silently)."""
    return {str(p.relative_to(root)): {"size": p.stat().st_size, "sha256": _hash_file(p)}
            for p in _shared_files(root, rank, world)}


def verify_checkpoint(path: Path, share: tuple[int, int] = (0, 1)) -> list[str]:
    """The problems of checkpoint ``path`` (its manifest, then ``share`` = (rank, world) of
    its files against the manifest's sizes and hashes), each naming a file; empty if it
    verifies. A checkpoint saved before hashes were recorded verifies by its manifest."""
    path = Path(path)
    try:
        manifest = json.loads((path / "manifest.json").read_text())
    except (OSError, ValueError) as e:
        return [f"{path / 'manifest.json'}: unreadable ({e})"] if share[0] == 0 else []
    files = manifest.get("files")
    if files is None:
        return []
    rank, world = share
    problems = [f"{path / name}: missing" for name in sorted(files)[rank::world] if not (path / name).is_file()]
    for p in _shared_files(path, rank, world):
        name = str(p.relative_to(path))
        want = files.get(name)
        if want is None:
            continue  # not part of the checkpoint when it was saved (e.g. a backup copy)
        if p.stat().st_size != want["size"]:
            problems.append(f"{p}: {p.stat().st_size} bytes, {want['size']} saved")
        elif _hash_file(p) != want["sha256"]:
            problems.append(f"{p}: content differs from the saved SHA-256")
    return problems


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

    # ---- the rollout servers' API key --------------------------------------------------
    @property
    def rollout_key_file(self) -> Path:
        return self.path / "rollout_api_key"

    def new_rollout_key(self) -> str:
        """A fresh random key for the rollout servers this run launches, kept in
        ``rollout_key_file`` (owner-only) for whoever else must call them (a user's curl,
        the Slurm launcher's steps). New at each launch: a key read from an earlier try
        opens nothing now."""
        key = new_key()
        write_private(self.rollout_key_file, key + "\n")
        return key

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

    # ---- one trainer per run ---------------------------------------------------------
    def lock(self):
        """Holds ``<run>/.lock`` until the returned file is closed or the process ends (the
        kernel releases a dead holder's lock, so a killed run's is taken over). A second
        trainer on the same run directory is refused, naming the holder: two interleave
        their stats rows and mix their checkpoint files. A POSIX record lock (lockf), not
        flock: a forked child (megatron's checkpoint writers fork) inherits an flock with
        the file descriptor and held it after its killed parent, refusing the resume."""
        import fcntl
        import socket

        self.path.mkdir(parents=True, exist_ok=True)
        f = open(self.path / ".lock", "a+")
        try:
            fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except (BlockingIOError, PermissionError):  # EAGAIN or EACCES: held elsewhere
            f.seek(0)
            holder = f.read().strip() or "another process"
            f.close()
            raise ValueError(f"run directory {self.path} is in use by {holder}: a second trainer there would "
                             f"corrupt its stats and checkpoints; stop that run first, or give this one "
                             f"another experiment_name (or trainer.log_dir)") from None
        except OSError as e:  # a filesystem without locks (ENOLCK, EOPNOTSUPP)
            print(f"[run_dir] warning: cannot lock {self.path / '.lock'} ({e.strerror}): nothing stops a "
                  f"second trainer on this run directory", file=sys.stderr, flush=True)
            return f
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%dT%H:%M:%S')}\n")
        f.flush()
        return f

    # ---- how the last trainer ended -------------------------------------------------
    @property
    def stopped_file(self) -> Path:
        return self.path / "STOPPED"

    def mark_stopped(self, step: int) -> None:
        """The trainer stopped early, checkpointed at ``step``, on a signal or STOP: what a
        launcher reads to requeue, since torchrun reports every worker's non-zero exit,
        EXIT_STOPPED included, as its own exit code 1."""
        write_atomic(self.stopped_file, f"{step}\n", fsync=False)

    def clear_stopped(self) -> None:
        self.stopped_file.unlink(missing_ok=True)

    def was_stopped(self) -> bool:
        return self.stopped_file.is_file()

    # ---- stats rows ------------------------------------------------------------------
    def append_stats(self, row: dict) -> None:
        append_jsonl(self.stats, row)

    def stats_rows(self) -> list[dict]:
        return read_jsonl(self.stats)

    def stats_tail(self, n: int) -> list[dict]:
        """The last ``n`` rows, read from the end of the file."""
        return read_jsonl(self.stats, last=n)

    def last_step(self) -> int:
        """The step of the last finished row (0 before the first)."""
        rows = self.stats_tail(1)
        return rows[-1]["step"] if rows else 0

    # ---- an earlier run in the same directory ---------------------------------------
    # What one run writes here (not the Slurm launcher's slurm/, nor the rollout key).
    RUN_OUTPUTS = ("stats.jsonl", "eval.jsonl", "curves.png", "trace.json", "tensorboard", "checkpoints",
                   "hf", "rollouts", "STOPPED")

    def earlier_run_refusal(self, total_steps: int, mode: str) -> str | None:
        """Why a run of ``total_steps`` with ``trainer.existing_run=mode`` must not start
        here, or None. "auto" resumes a checkpoint short of ``total_steps`` (a stopped run
        rerun, a requeued job) or one at its end without its final HF export; a finished run
        (checkpointed and exported), or stats rows without a checkpoint (a fresh
        start sets them aside), need a flag to say what is meant ("resume" does what "auto"
        would have done silently; the Slurm launcher's requeued tries pass it)."""
        if mode != "auto":
            return None
        step, rows = self.checkpoint_step(), self.last_step()
        fix = (f"--overwrite (trainer.existing_run=overwrite) starts afresh, its files moved to "
               f"{self.path}/before-<time>/; or give this run another experiment_name")
        # A run killed during its final export resumes to write it (the export is its last act).
        if step and step >= total_steps and (self.path / "hf" / f"step_{step}" / "config.json").is_file():
            return (f"{self.path} holds a finished run (its checkpoint of step {step}, and trainer.total_steps="
                    f"{total_steps}): trainer.total_steps above {step} trains it on; {fix}")
        if not step and rows:
            return (f"{self.path} holds an earlier run's stats ({rows} steps) and no checkpoint to resume: "
                    f"--resume (trainer.existing_run=resume) starts afresh, its stats set aside; {fix}")
        return None

    def claim(self, total_steps: int, mode: str):
        """Takes the run directory for a trainer of ``total_steps`` with
        ``trainer.existing_run=mode``: (its ``lock``, None), or (None, why not): another trainer
        holds it, or an earlier run is here that this one would silently redo or set aside
        (``earlier_run_refusal``)."""
        try:
            lock = self.lock()
        except ValueError as e:
            return None, str(e)
        why = self.earlier_run_refusal(total_steps, mode)
        if why:
            lock.close()
            return None, why
        return lock, None

    def start_refusal(self, total_steps: int, mode: str) -> str | None:
        """``claim``'s refusal, or None, with the lock let go again: what ``areal-mcore train``
        checks before it starts anything (the trainer claims the directory when it starts)."""
        if not self.path.is_dir():
            return None
        lock, why = self.claim(total_steps, mode)
        if lock is not None:
            lock.close()
        return why

    def set_aside(self) -> Path | None:
        """Moves the earlier run's files (``RUN_OUTPUTS``) into ``<run>/before-<time>/``;
        returns that folder, or None when there was nothing to move."""
        found = [self.path / name for name in self.RUN_OUTPUTS if (self.path / name).exists()]
        if not found:
            return None
        aside = self.path / f"before-{time.strftime('%Y%m%d-%H%M%S')}"
        aside.mkdir()
        for path in found:
            path.rename(aside / path.name)
        return aside

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


def append_jsonl(path: Path, row: dict) -> None:
    """Appends one whole line or nothing: the line is written, flushed and fsynced, and on
    an OS error (ENOSPC, EIO, ...) the file is cut back to where it was, so no torn line is
    left for a later read, and the error names the file (a bare write error names none)."""
    line = (json.dumps(row) + "\n").encode()
    with open(path, "ab") as f:
        start = f.tell()
        try:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        except OSError as e:
            try:
                f.truncate(start)
            except OSError:
                pass  # read_jsonl drops a torn last line
            raise OSError(e.errno, f"{e.strerror} while appending to {path}", str(path)) from e


def read_jsonl(path: Path, *, last: int | None = None) -> list[dict]:
    """The rows of a JSONL file (``last``: its last rows only, read from the end: launchers
    poll it every second). A torn last line (a write cut short: a full disk, a kill; or one
    being appended right now) is dropped, with a warning on a whole read. Any other
    unreadable line is an error naming the file (and the line, on a whole read)."""
    if not path.is_file():
        return []
    data, first = (path.read_bytes(), 1) if last is None else (_tail(path, last + 1), None)
    lines = data.split(b"\n")
    rows = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
            if i >= len(lines) - 1:  # the last line (with or without its newline)
                if first is not None:
                    print(f"[run_dir] warning: {path}:{i}: dropped a torn last line ({len(line)} bytes)",
                          file=sys.stderr, flush=True)
                break
            where = f"{path}:{i}" if first is not None else f"{path} (near its end)"
            raise ValueError(f"{where}: not a JSON row ({e}); the file is damaged") from None
    return rows if last is None else rows[-last:]


def _tail(path: Path, lines: int, block: int = 1 << 16) -> bytes:
    """The bytes of ``path``'s last ``lines`` whole lines (and a partial last one)."""
    with open(path, "rb") as f:
        end = f.seek(0, os.SEEK_END)
        data, pos = b"", end
        while pos > 0 and data.count(b"\n") <= lines:
            pos = max(0, pos - block)
            f.seek(pos)
            data = f.read(end - pos)
    return data if pos == 0 else data.split(b"\n", 1)[1]  # from a line's start


class Status:
    """A Slurm job's ``status.json``: fields kept in memory, the file rewritten on each change."""

    def __init__(self, run: RunDir, **fields):
        self.run, self.fields = run, fields

    def update(self, **fields) -> None:
        self.fields.update(fields, updated=time.strftime("%Y-%m-%dT%H:%M:%S"))
        self.run.write_status(self.fields)
