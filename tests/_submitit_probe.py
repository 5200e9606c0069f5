"""A callable for submitit jobs that stands in for ``LaunchJob`` where a test needs only
submitit's signal path: the first try waits for the time-limit signal, and the try that
submitit requeues from ``checkpoint``'s answer returns. Pickled by value
(``cloudpickle.register_pickle_by_value``): the job's Python does not import tests/."""

from __future__ import annotations

import os
import time
from pathlib import Path


class Probe:
    def __init__(self, started: str, tries: int = 0):
        self.started, self.tries = started, tries

    def __call__(self) -> dict:
        Path(self.started).write_text(f"{self.tries}\n")
        if self.tries == 0:
            time.sleep(300)  # the test signals within this; submitit's handler exits the try
            raise RuntimeError("no time-limit signal reached the job's Python")
        return {"tries": self.tries + 1, "restart_count": os.environ.get("SLURM_RESTART_COUNT")}

    def checkpoint(self, *args, **kwargs):
        import submitit

        return submitit.helpers.DelayedSubmission(Probe(self.started, self.tries + 1))
