"""A seeded epoch sampler whose position is part of a checkpoint (exact resume)."""

from __future__ import annotations

import numpy as np


class EpochSampler:
    """Yields batches of dataset indices; every epoch is a permutation seeded by (seed, epoch).

    ``state_dict()`` is two integers, so the trainer stores it in the checkpoint's extra
    state and a resumed run continues with the very next batch.
    """

    def __init__(self, n: int, batch_size: int, seed: int):
        if n < batch_size:
            raise ValueError(f"dataset has {n} problems, fewer than batch_size={batch_size}")
        self.n, self.batch_size, self.seed = n, batch_size, seed
        self.epoch, self.position = 0, 0

    def _order(self) -> np.ndarray:
        return np.random.default_rng([self.seed, self.epoch]).permutation(self.n)

    def next_batch(self) -> list[int]:
        """The next batch; an epoch's tail shorter than a batch is dropped."""
        if self.position + self.batch_size > self.n:
            self.epoch, self.position = self.epoch + 1, 0
        batch = self._order()[self.position : self.position + self.batch_size]
        self.position += self.batch_size
        return batch.tolist()

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
