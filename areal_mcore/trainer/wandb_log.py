"""Weights & Biases beside TensorBoard: the same per-step scalars and eval rows, the
resolved config, and ``curves.png`` at the end (``trainer.wandb``, off by default).

A resumed run (requeue, restart) continues the same W&B run: its id travels in the
checkpoint's extra state, and it sends only the steps after its checkpoint (the eval the
resume repeats at the checkpoint's step is not sent again). A run stopped by SIGTERM or
SIGUSR2 (Slurm's preemption and time-limit signals) checkpoints its last step and closes
its W&B run, so the resumed W&B history holds each step once. A SIGKILLed attempt is
another matter: W&B's service buffers history rows, and on a 4-step CPU run a SIGKILL lost
every row it had been sent (offline); the steps it ran past its checkpoint are sent again
by the resumed run, and W&B's server drops any it already holds (steps must increase).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

from areal_mcore.checks import FieldError, check_choice, field_error

WANDB_MODES = ("disabled", "offline", "online")
NEEDS_WANDB = ("needs the wandb package, which is optional: pip install 'areal-mcore[wandb]' "
               "(or set trainer.wandb.mode=disabled)")


@dataclass(kw_only=True)
class WandbConfig:
    mode: str = "disabled"  # online | offline (files under <run>/wandb, `wandb sync` later) | disabled
    project: str = "areal-mcore"
    entity: str | None = None  # team or user; None: the account's default
    name: str | None = None  # display name; None: experiment_name
    tags: list[str] = field(default_factory=list)

    def __post_init__(self):
        check_choice("mode", self.mode, WANDB_MODES)
        if not self.project:
            raise field_error("project", self.project, "must be a non-empty W&B project name")
        if self.enabled and importlib.util.find_spec("wandb") is None:  # at load, before any rank starts
            raise FieldError("mode", f"={self.mode} {NEEDS_WANDB}")

    @property
    def enabled(self) -> bool:
        return self.mode != "disabled"


def import_wandb(mode: str):
    """The ``wandb`` module, or a ValueError naming the extra that installs it."""
    try:
        import wandb
    except ImportError:
        raise ValueError(f"trainer.wandb.mode={mode} {NEEDS_WANDB}") from None
    return wandb


class WandbLogger:
    """One W&B run per experiment, continued across resumes."""

    def __init__(self, cfg: WandbConfig, run_dir: Path, *, experiment_name: str, config: dict,
                 run_id: str | None = None, start_step: int = 0):
        wandb = import_wandb(cfg.mode)
        self._wandb = wandb
        # Steps up to the checkpoint were sent by the attempt that wrote it.
        self.floor = start_step if run_id is not None else -1
        self.last_step = max(self.floor, 0)
        self.run = wandb.init(
            project=cfg.project, entity=cfg.entity, name=cfg.name or experiment_name, tags=list(cfg.tags),
            mode=cfg.mode, dir=str(run_dir), id=run_id,  # None: W&B picks one
            resume="allow", config=config, settings=wandb.Settings(silent=True, console="off"))
        self.run_id = self.run.id

    def log(self, step: int, scalars: dict[str, float]) -> None:
        """Scalars at ``step``; a step the resumed checkpoint's attempt sent is dropped."""
        if step <= self.floor or not scalars:
            return
        self.run.log(scalars, step=step)
        self.last_step = step

    def image(self, key: str, path: Path) -> None:
        self.run.log({key: self._wandb.Image(str(path))}, step=self.last_step)

    def finish(self) -> None:
        self.run.finish()
