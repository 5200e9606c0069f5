"""Training checkpoints: atomic, sharded, exactly resumable.

Layout under ``root``::

    latest                      name of the newest complete checkpoint
    step_00000042/
      manifest.json             step, weight version, layout, versions, model args, config,
                                and every other file's size and SHA-256 (written last)
      model/                    megatron dist_checkpointing: model + distributed optimizer
      trainer_state.pt          LR scheduler, step, weight version, caller's extra state
      rng/rank_00003.pt         per-rank RNG: python, numpy, torch, megatron tracker

A checkpoint is written into a hidden temporary folder, fsynced, and renamed into place
before ``latest`` is replaced (also by rename), so a crash mid-save leaves the previous
checkpoint and pointer untouched; a failed save (a full disk) removes its temporary folder
and raises the OS error naming it, on every rank. Loading verifies the files against the
manifest's hashes and falls back to the newest checkpoint that verifies, saying which it
skipped and why (``areal-mcore verify-checkpoint DIR`` checks one by hand). Resuming with
another data- or context-parallel size works (the optimizer state, sharded over DP x CP, is
saved DP-reshardable; CP ranks hold the same weights); another TP/PP layout is rejected with a
message pointing at the HF conversion tools, and so is a checkpoint saved by a newer
megatron-core than the one running (``mcore_compat.resume_refusal``; older ones load).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import queue
import random
import re
import shutil
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from torch.distributed.checkpoint.api import CheckpointException

from areal_mcore import collectives
from areal_mcore.actor.megatron_actor import MegatronActor
from areal_mcore.model import mcore_compat
from areal_mcore.model.args import ModelArgs, args_mismatch
from areal_mcore.run_dir import (
    LATEST,
    checkpoint_name,
    hash_files,
    latest_checkpoint,
    point_latest_at,
    verify_checkpoint,
    write_atomic,
)

FORMAT = "areal-mcore-ckpt-v1"
# A write that failed without an errno, on a filesystem with less than this left, ran out of space.
FULL_BELOW = 1 << 20


@dataclass(kw_only=True)
class CheckpointConfig:
    root: str
    keep_last: int = 2

    def __post_init__(self):
        if self.keep_last < 1:
            raise ValueError(f"keep_last={self.keep_last} must be >= 1")


@dataclass
class ResumeState:
    path: Path
    step: int
    weight_version: int
    extra: dict
    # Weights alone (``convert hf-to-mcore``): no trainer state, scheduler or RNG was restored.
    weights_only: bool = False


class Checkpointer:
    """Saves and restores a ``MegatronActor`` plus trainer state; every rank calls both.

    ``group`` spans all trainer ranks (barriers and the shared folder name go over it).
    """

    def __init__(self, cfg: CheckpointConfig, group: dist.ProcessGroup):
        self.cfg = cfg
        self.root = Path(cfg.root)
        self.group = group

    # ------------------------------------------------------------------ save

    def save(self, actor: MegatronActor, *, step: int, weight_version: int, extra: dict | None = None,
             config_snapshot: dict | None = None, weights_only: bool = False) -> Path:
        """Writes checkpoint ``step``; returns its folder once it is complete everywhere.
        ``weights_only``: a starting point (an imported model), whose learning-rate
        schedule and RNG a run that loads it must not take over."""
        rank = dist.get_rank()
        name = checkpoint_name(step)
        tmp = self.root / f".{name}.tmp"
        if rank == 0:
            for stale in self.root.glob(".step_*.tmp"):  # left by a crashed save
                shutil.rmtree(stale)
            (tmp / "model").mkdir(parents=True)
            (tmp / "rng").mkdir()
        collectives.barrier(self.group)
        manifest = self._agree(lambda: self._write(actor, tmp, step=step, weight_version=weight_version,
                                                   extra=extra, config_snapshot=config_snapshot),
                               tmp, step)
        if manifest is not None:
            manifest["weights_only"] = weights_only
        # Every rank wrote its part (the gather in _agree is the barrier): each hashes its
        # share of the files, rank 0 records them all in the manifest, written last.
        hashes = self._agree(lambda: hash_files(tmp, rank, dist.get_world_size(self.group)), tmp, step)
        files = {k: v for part in collectives.all_gather_object(hashes, self.group) for k, v in part.items()}
        self._agree(lambda: rank == 0 and write_atomic(tmp / "manifest.json",
                                                       json.dumps({**manifest, "files": files}, indent=1)),
                    tmp, step)
        final = self.root / name
        if rank == 0:
            _fsync_tree(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            point_latest_at(self.root, name)
            _fsync_dir(self.root)
            self._prune(keep=final)
        collectives.barrier(self.group)
        return final

    def _agree(self, write, tmp: Path, step: int):
        """``write()`` on every rank; if it failed on any, every rank raises (one rank's full
        disk must not leave the others at a barrier) and the temporary folder goes."""
        try:
            result, error = write(), None
        # torch's CheckpointException, what megatron's sharded save raises when its writer
        # process failed (filesystem_async.py, retrieve_write_results -> state_dict_saver.py,
        # save_state_dict_async_finalize), derives from BaseException, not Exception
        # (torch/distributed/checkpoint/api.py): uncaught here, this rank left the others
        # waiting at the gather below and the run's error never named the checkpoint.
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - every rank learns of it below
            result, error = None, e
        errors = [e for e in collectives.all_gather_object(error and f"{type(error).__name__}: {error}",
                                                             self.group) if e]
        if not errors:
            return result
        code = _errno(error, tmp)  # before the removal below frees the space it looks at
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        why = (f"checkpoint of step {step} failed writing {tmp} (removed; {self.root / LATEST} still "
               f"names the previous checkpoint): {errors[0]}")
        if code is not None:  # ENOSPC, EACCES, EIO stay OS errors, as the writer had them
            raise OSError(code, why, str(tmp)) from error
        raise RuntimeError(why) from error

    def _write(self, actor: MegatronActor, tmp: Path, *, step: int, weight_version: int,
               extra: dict | None, config_snapshot: dict | None) -> dict | None:
        """This rank's files; on rank 0 also the trainer state, and the manifest's fields."""
        rank = dist.get_rank()
        _write_results_in_process()
        dist_checkpointing.save(actor.sharded_state_dict(), str(tmp / "model"))
        _save_file(_rng_state(), tmp / "rng" / f"rank_{rank:05d}.pt")
        if rank == 0:
            g = actor.groups
            _save_file({"step": step, "weight_version": weight_version,
                        "scheduler": actor.scheduler.state_dict(), "extra": extra or {}},
                       tmp / "trainer_state.pt")
            manifest = {
                "format": FORMAT, "step": step, "weight_version": weight_version,
                "layout": {"tp": g.tp_size, "pp": g.pp_size, "ep": g.ep_size, "dp": g.dp_size,
                           "cp": g.cp_size, "world": dist.get_world_size(self.group)},
                "versions": {"torch": torch.__version__,
                             "megatron_core": mcore_compat.MCORE_VERSION_STR},
                "model_args": dataclasses.asdict(actor.args),
                "padded_vocab": actor.padded_vocab,
                "hf_config": actor.hf_config.to_dict(),
                "config": config_snapshot or {},
            }
            return manifest
        return None

    def _prune(self, keep: Path) -> None:
        done = sorted(p for p in self.root.glob("step_*") if p.is_dir())
        for old in done[: -self.cfg.keep_last]:
            if old != keep:
                shutil.rmtree(old)

    # ------------------------------------------------------------------ load

    def latest(self) -> Path | None:
        path = latest_checkpoint(self.root)
        if path is not None and not (path / "manifest.json").exists():
            raise FileNotFoundError(f"{self.root / LATEST} names {path.name}, which is missing or incomplete: "
                                    f"point it at a complete step_* folder there, or remove it to start afresh")
        return path

    def verify(self, path: Path) -> list[str]:
        """What is wrong with checkpoint ``path`` (empty: it verifies), every rank checking
        its share of the files against the manifest's hashes."""
        rank, world = dist.get_rank(), dist.get_world_size(self.group)
        mine = verify_checkpoint(path, share=(rank, world))
        return [p for part in collectives.all_gather_object(mine, self.group) for p in part]

    def load(self, actor: MegatronActor, path: Path | None = None) -> ResumeState | None:
        """Restores ``actor`` from ``path`` (default: the newest checkpoint that verifies,
        saying which it skipped and why); None if there is none. A ``path`` given that does
        not verify is an error naming its files."""
        if path is not None:
            problems = self.verify(Path(path))
            if problems:
                raise ValueError(f"checkpoint {path} does not verify: {'; '.join(problems[:5])}")
            return self._load(actor, Path(path))
        newest = self.latest()
        if newest is None:
            return None
        older = sorted((p for p in self.root.glob("step_*") if p.is_dir() and p != newest), reverse=True)
        skipped = []
        for candidate in [newest, *older]:
            problems = self.verify(candidate)
            if not problems:
                if skipped and dist.get_rank() == 0:
                    print(f"[checkpoint] resuming from {candidate.name}: newer checkpoint(s) do not verify: "
                          + "; ".join(skipped), file=sys.stderr, flush=True)
                return self._load(actor, candidate)
            skipped.append(f"{candidate.name}: {', '.join(problems[:3])}")
        raise ValueError(f"no checkpoint in {self.root} verifies ({'; '.join(skipped)}): remove the "
                         f"damaged ones to start afresh, or restore them from a copy")

    def _load(self, actor: MegatronActor, path: Path) -> ResumeState:
        manifest = json.loads((path / "manifest.json").read_text())
        _check_compatible(manifest, actor, path)
        weights_only = bool(manifest.get("weights_only"))  # not the converter's optimizer, schedule, RNG
        sharded = actor.sharded_state_dict(for_loading=True, weights_only=weights_only)
        actor.load_sharded_state(dist_checkpointing.load(sharded, str(path / "model")), weights_only)
        trainer = torch.load(path / "trainer_state.pt", weights_only=False)
        if not weights_only:
            actor.scheduler.load_state_dict(trainer["scheduler"])
            rng = path / "rng" / f"rank_{dist.get_rank():05d}.pt"
            if manifest["layout"]["world"] == dist.get_world_size(self.group) and rng.exists():
                _set_rng_state(torch.load(rng, weights_only=False))
            else:
                warnings.warn(f"{path}: saved with another world size; RNG states are not restored",
                              stacklevel=2)
        collectives.barrier(self.group)
        return ResumeState(path=path, step=trainer["step"], weight_version=trainer["weight_version"],
                           extra=trainer["extra"], weights_only=weights_only)


def _check_compatible(manifest: dict, actor: MegatronActor, path: Path) -> None:
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path}: not an {FORMAT} checkpoint (format={manifest.get('format')!r})")
    saved, g = manifest["layout"], actor.groups
    if (saved["tp"], saved["pp"]) != (g.tp_size, g.pp_size):
        raise ValueError(
            f"{path} was saved with tp={saved['tp']}, pp={saved['pp']}; this run has tp={g.tp_size}, "
            f"pp={g.pp_size}. Resuming with another TP/PP layout is not supported: set "
            f"actor.parallel.tp/pp to match, or export to HF and import at the new layout "
            f"(tools/convert_ckpt). Another data-parallel size is fine."
        )
    if saved.get("ep", 1) != g.ep_size:  # checkpoints from before EP: 1
        # Not tried: whether the DP-reshardable optimizer state (one distributed-optimizer
        # buffer per expert-DP group) reshards to another EP is not tested here.
        raise ValueError(f"{path} was saved with ep={saved.get('ep', 1)}; this run has "
                         f"actor.parallel.ep={g.ep_size}: set it to match, or export to HF and import")
    saved_mcore = manifest.get("versions", {}).get("megatron_core")
    refusal = saved_mcore and mcore_compat.resume_refusal(saved_mcore)
    if refusal:
        raise ValueError(f"{path} cannot be resumed: {refusal}")
    diff = args_mismatch(ModelArgs(**manifest["model_args"]), actor.args, "checkpoint", "model")
    if diff:
        raise ValueError(f"{path}: the model does not match the checkpoint ({diff})")
    # The embedding, LM head and their optimizer state are saved at the padded shape, which
    # megatron's load refuses to reshape ("Global shape mismatch"): name the key instead.
    padded = manifest.get("padded_vocab")  # checkpoints from before it was recorded: unchecked
    if padded is not None and padded != actor.padded_vocab:
        raise ValueError(
            f"{path} pads the vocabulary ({actor.args.vocab_size}) to {padded} rows; this run pads it to "
            f"{actor.padded_vocab} (actor.vocab_divisible_by={actor.cfg.vocab_divisible_by} x tp={g.tp_size}): "
            f"set actor.vocab_divisible_by to the checkpoint's (for `convert hf-to-mcore`, its "
            f"--vocab-divisible-by), or convert again with --vocab-divisible-by "
            f"{actor.cfg.vocab_divisible_by}")


# --------------------------------------------------------------------------- RNG


def _rng_state() -> dict:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "tracker": get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


# --------------------------------------------------------------------------- files


def _save_file(obj, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _errno(error: BaseException | None, tmp: Path) -> int | None:
    """The OS error number of ``error``: its own, or the one megatron's writer process
    reported only as text ("Worker failure: [Errno 28] No space left on device"), or ENOSPC
    where the error has none but ``tmp``'s filesystem is full: ``torch.save`` to a path
    (megatron's ``save_common``, dist_checkpointing/strategies/common.py) writes through a
    C++ ofstream, whose failure reaches Python as "basic_ios::clear: iostream error"."""
    if error is None:
        return None
    if isinstance(error, OSError):
        return error.errno
    found = re.search(r"\[Errno (\d+)\]", str(error)) if isinstance(error, CheckpointException) else None
    if found:
        return int(found.group(1))
    try:
        full = shutil.disk_usage(tmp.parent).free < FULL_BELOW
    except OSError:
        return None
    return errno.ENOSPC if full else None


def _write_results_in_process() -> None:
    """megatron's sharded save hands its writer's results to its finalize step through the
    queue cached in ``filesystem_async._results_queue`` (``_get_write_results_queue`` in
    megatron-core 0.16.1, ``get_write_results_queue`` in 0.19.2). Left to megatron, that is
    a multiprocessing Manager's queue: a spawned server process, made for the *async* save,
    whose writer runs in another process. Ours is synchronous: ``dist_checkpointing.save``
    runs the writer (its ``put``) and the finalize (``retrieve_write_results``:
    ``get_nowait``) in this process (``AsyncRequest.execute_sync``), so a plain queue
    serves, and no helper process is left for a signal to kill. The Manager ignores SIGINT
    (``multiprocessing/managers.py`` ``BaseManager._run_server``) but not SIGTERM, which
    scancel, ``scontrol requeue`` (every process of the step) and torchrun (``os.killpg``
    of each worker's group) deliver: the stop checkpoint then failed with BrokenPipeError
    (EOFError while the Manager was starting). A new queue per save: a failed save leaves
    no result behind for the next one."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async._results_queue = queue.Queue()


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(Path(dirpath))
