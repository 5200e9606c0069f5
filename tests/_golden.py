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
by instruction set, and the summation order of a threaded op by the thread count. So each
kind of machine has its own recording, ``<name>.<kind>.jsonl`` (``kind``: the newest
instruction set of ``_ISA`` the CPU has and its core count, e.g. ``avx2-2cpu``), whose first
line names the machine. Where no recording of this kind exists, the comparison is skipped
naming the kinds recorded, and ``make golden`` records one. A deliberate numeric change (a
recipe, the loss maths) re-records with ``make golden``, in a commit that says why, and
deletes the recordings of the kinds it could not re-record on.
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


def kind(m: dict) -> str:
    """The recording's file suffix for machine ``m``, e.g. ``avx2-2cpu``."""
    return f"{m['isa'][-1] if m['isa'] else 'noavx'}-{m['cpus']}cpu"


def numbers(row: dict) -> dict:
    """A stats row without its clocks (``time/*``, ``perf/*``, ``*time_s``)."""
    return {k: v for k, v in row.items() if not k.startswith(("time/", "perf/")) and not k.endswith("time_s")}


def check_or_record(name: str, rows: list[dict], near: dict[str, float] | None = None) -> None:
    """Compares the first ``STEPS`` rows with ``tests/golden/<name>.jsonl`` (or records them
    under ``AREAL_GOLDEN=record``); fails at the first step that differs, naming its fields.
    ``near``: field prefix -> the absolute difference allowed there; every other field is
    compared exactly."""
    near = near or {}
    here = machine()
    path = GOLDEN / f"{name}.{kind(here)}.jsonl"
    got = [numbers(r) for r in rows[:STEPS]]
    assert len(got) == STEPS, f"{len(got)} steps, the golden trajectory has {STEPS}"
    if RECORD:
        GOLDEN.mkdir(exist_ok=True)
        path.write_text("".join(json.dumps(x) + "\n" for x in [{"machine": here}, *got]))
        return
    if not path.exists():
        kinds = sorted(p.name.split(".")[1] for p in GOLDEN.glob(f"{name}.*.jsonl"))
        pytest.skip(f"{name} is recorded for {kinds}, not for this machine ({here}): `make golden` records it")
    header, *want = [json.loads(x) for x in path.read_text().splitlines()]
    assert header["machine"] == here, f"{path} holds another machine's numbers: {header['machine']}"
    for step, (w, g) in enumerate(zip(want, got), start=1):
        bad = {k: (v, g.get(k, "missing")) for k, v in w.items() if not _same(k, v, g.get(k, "missing"), near)}
        assert not bad, (f"{name}: step {step} left the golden trajectory ({path}); "
                         f"field: (recorded, now): {bad}. A deliberate change re-records it: make golden")


def _same(key: str, want, got, near: dict[str, float]) -> bool:
    tol = next((t for prefix, t in near.items() if key.startswith(prefix)), None)
    if tol is None or not isinstance(want, float) or not isinstance(got, float):
        return want == got
    return abs(want - got) <= tol
