"""The doctor's result: one row per check, as a table, a JSON file and an exit code."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

STATES = ("pass", "warn", "fail", "skip")


@dataclass
class Check:
    """One finding: ``measured`` against ``expected``, and what to do (``fix``) when it is not
    a pass. ``where``: the node it was measured on, or ``job`` for the allocation's own."""

    name: str
    state: str
    measured: str
    expected: str = ""
    fix: str = ""
    where: str = "job"

    def __post_init__(self):
        assert self.state in STATES, self.state

    @property
    def line(self) -> str:
        """The one-line reason: what was found, what was expected, what to do."""
        want = f" (expected {self.expected})" if self.expected else ""
        todo = f": {self.fix}" if self.fix and self.state in ("warn", "fail") else ""
        return f"{self.state.upper()} {self.name} on {self.where}: {self.measured}{want}{todo}"


def fail(name: str, measured: str, expected: str, fix: str, where: str = "job") -> Check:
    return Check(name, "fail", measured, expected, fix, where)


def format_table(checks: list[Check]) -> str:
    """Passing checks in one line each; failures and warnings with what to do, last, so that
    they end the job's log."""
    order = sorted(checks, key=lambda c: ("pass", "skip", "warn", "fail").index(c.state))
    width = max((len(c.name) for c in order), default=5)
    where = max((len(c.where) for c in order), default=3)
    rows = [f"{'check':<{width}}  {'node':<{where}}  state  measured (expected)"]
    for c in order:
        want = f" (expected {c.expected})" if c.expected else ""
        rows.append(f"{c.name:<{width}}  {c.where:<{where}}  {c.state:<5}  {c.measured}{want}")
        if c.fix and c.state in ("warn", "fail"):
            rows.append(f"{'':<{width}}  {'':<{where}}  {'':<5}  -> {c.fix}")
    fails = sum(c.state == "fail" for c in checks)
    warns = sum(c.state == "warn" for c in checks)
    rows.append(f"doctor: {len(checks)} checks, {fails} failed, {warns} warnings")
    return "\n".join(rows)


def write_json(checks: list[Check], path: Path, **about) -> None:
    from areal_mcore.run_dir import write_atomic

    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps({**about, "checks": [asdict(c) for c in checks],
                                   "failed": [c.line for c in checks if c.state == "fail"]}, indent=1), fsync=False)


def exit_code(checks: list[Check], *, warn_only: bool = False) -> int:
    """1 when a check failed (0 with ``warn_only``: the admin starts anyway), else 0."""
    return int(not warn_only and any(c.state == "fail" for c in checks))
