"""Golden trajectories: the per-step stats of seeded tiny runs, recorded in tests/golden/.

A run of the same commit and config repeats its stats bitwise on each backend: the
trainer's CPU maths is deterministic, the embedded server draws each sample from a
generator seeded by (run seed, group, sample), and vLLM gets the same seed per request
(rollout/engines/vllm.py; measured batch- and order-invariant on CPU). So every field
but the clocks is compared exactly: the loss, the grad norm, the rewards, the drift. One
exception: the embedded server's logprobs depend in their last bits on which requests it
batched together (timing), so its drift fields (the server-trainer logprob gap, ~3e-7 on
fp32) moved by up to 6e-7 between two runs; they are compared within 1e-5, a hundredth of
the drift alarm's 1e-3. Its tokens do not move (each sample's generator draws them), nor
anything the trainer computes from them.

The numbers hold for one kind of machine: CPU kernels (oneDNN, vLLM's) pick their code
by instruction set, and the summation order of a threaded op by the thread count. The
recording names the machine; on another, the comparison is skipped with both named, and
``make golden`` records for it. A deliberate numeric change (a recipe, the loss maths)
re-records with ``make golden``, in a commit that says why.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

GOLDEN = Path(__file__).parent / "golden"
STEPS = 20
RECORD = os.environ.get("AREAL_GOLDEN") == "record"
_ISA = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile")


def machine() -> dict:
    import torch

    flags: set[str] = set()
    if os.path.exists("/proc/cpuinfo"):
        flags = set(Path("/proc/cpuinfo").read_text().split())
    return {"torch": torch.__version__, "cpus": os.cpu_count(), "isa": [f for f in _ISA if f in flags]}


def numbers(row: dict) -> dict:
    """A stats row without its clocks (``time/*``, ``perf/*``, ``*time_s``)."""
    return {k: v for k, v in row.items() if not k.startswith(("time/", "perf/")) and not k.endswith("time_s")}


def check_or_record(name: str, rows: list[dict], near: dict[str, float] | None = None) -> None:
    """Compares the first ``STEPS`` rows with ``tests/golden/<name>.jsonl`` (or records them
    under ``AREAL_GOLDEN=record``); fails at the first step that differs, naming its fields.
    ``near``: field prefix -> the absolute difference allowed there; every other field is
    compared exactly."""
    near = near or {}
    path = GOLDEN / f"{name}.jsonl"
    got = [numbers(r) for r in rows[:STEPS]]
    assert len(got) == STEPS, f"{len(got)} steps, the golden trajectory has {STEPS}"
    if RECORD:
        GOLDEN.mkdir(exist_ok=True)
        path.write_text("".join(json.dumps(x) + "\n" for x in [{"machine": machine()}, *got]))
        return
    header, *want = [json.loads(x) for x in path.read_text().splitlines()]
    if header["machine"] != machine():
        pytest.skip(f"{path.name} was recorded on {header['machine']}, this machine is {machine()}: "
                    "`make golden` records it here")
    for step, (w, g) in enumerate(zip(want, got), start=1):
        bad = {k: (v, g.get(k, "missing")) for k, v in w.items() if not _same(k, v, g.get(k, "missing"), near)}
        assert not bad, (f"{name}: step {step} left the golden trajectory ({path}); "
                         f"field: (recorded, now): {bad}. A deliberate change re-records it: make golden")


def _same(key: str, want, got, near: dict[str, float]) -> bool:
    tol = next((t for prefix, t in near.items() if key.startswith(prefix)), None)
    if tol is None or not isinstance(want, float) or not isinstance(got, float):
        return want == got
    return abs(want - got) <= tol
