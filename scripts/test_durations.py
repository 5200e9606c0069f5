"""What `make test` cost, test by test, from the JUnit XML files its stages write.

    python scripts/test_durations.py build/test-reports/*.xml            # the 25 slowest, seconds per module
    python scripts/test_durations.py --markdown --fold-below 30 build/test-reports/*.xml  # docs/tests.md's table
    python scripts/test_durations.py --order tests/module_seconds.json build/test-reports/*.xml  # the suite's order

Each file is one stage (its name without .xml: main, mcore019). A test's seconds are
pytest's: setup + call + teardown, so a module-scoped fixture (a server, an SFT warm-up)
counts in the first test that asks for it. Seconds are wall time inside a worker that
shares the machine's cores with the other workers, the 0.19 stage and every process the
tests start: compare them with each other and between runs on one machine, not as CPU.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def read(paths: list[Path]) -> list[tuple[str, str, str, float, str]]:
    """(stage, module, test, seconds, outcome) of every test case in the files."""
    rows = []
    for path in paths:
        for case in ET.parse(path).getroot().iter("testcase"):
            module = (case.get("classname") or "?").rsplit(".", 1)[-1]
            outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
            rows.append((path.stem, module, case.get("name", "?"), float(case.get("time") or 0), outcome))
    return rows


def per_module(rows) -> list[tuple[str, str, int, float, float]]:
    """(stage, module, tests, seconds, slowest test's seconds), the costliest first."""
    seconds, count, slowest = collections.Counter(), collections.Counter(), collections.Counter()
    for stage, module, _, s, _ in rows:
        seconds[stage, module] += s
        count[stage, module] += 1
        slowest[stage, module] = max(slowest[stage, module], s)
    return [(stage, module, count[stage, module], s, slowest[stage, module])
            for (stage, module), s in seconds.most_common()]


def text_report(rows, top: int) -> str:
    out = [f"the {top} slowest tests (seconds: setup + call + teardown, in a worker sharing the cores):"]
    for stage, module, name, s, outcome in sorted(rows, key=lambda r: -r[3])[:top]:
        mark = "" if outcome == "passed" else f"  [{outcome}]"
        out.append(f"  {s:7.1f}  {stage:8s} {module}::{name}{mark}")
    out.append("seconds per module (stage, tests, seconds, slowest test):")
    for stage, module, n, s, slowest in per_module(rows):
        out.append(f"  {s:7.1f}  {stage:8s} {module:34s} {n:4d} tests, slowest {slowest:6.1f}")
    for stage in sorted({r[0] for r in rows}):
        mine = [r for r in rows if r[0] == stage]
        out.append(f"{stage}: {len(mine)} tests, {sum(r[3] for r in mine):.0f} test-seconds")
    return "\n".join(out)


def markdown(rows, fold_below: float) -> str:
    """The per-module table; a stage's modules under ``fold_below`` seconds share one row."""
    out = ["| stage | module | tests | seconds | slowest test (s) |", "|---|---|---:|---:|---:|"]
    modules = per_module(rows)
    out += [f"| {stage} | `{module}` | {n} | {s:.0f} | {slowest:.0f} |"
            for stage, module, n, s, slowest in modules if s >= fold_below]
    for stage in sorted({r[0] for r in rows}):
        small = [m for m in modules if m[0] == stage and m[3] < fold_below]
        if small:
            out.append(f"| {stage} | {len(small)} modules under {fold_below:.0f} s each | {sum(m[2] for m in small)} "
                       f"| {sum(m[3] for m in small):.0f} | {max(m[4] for m in small):.0f} |")
    for stage in sorted({r[0] for r in rows}):
        mine = [r for r in rows if r[0] == stage]
        out.append(f"| {stage} | all | {len(mine)} | {sum(r[3] for r in mine):.0f} | |")
    return "\n".join(out)


def module_seconds(rows) -> dict[str, dict[str, int]]:
    """{stage: {module: seconds}}: what tests/conftest.py orders the modules by."""
    out: dict[str, dict[str, int]] = {}
    for stage, module, _, s, _ in per_module(rows):
        out.setdefault(stage, {})[module] = round(s)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", type=Path, help="JUnit XML files, one per stage")
    p.add_argument("--top", type=int, default=25, help="how many of the slowest tests to list")
    p.add_argument("--markdown", action="store_true", help="print the per-module table as Markdown")
    p.add_argument("--fold-below", type=float, default=0, metavar="S",
                   help="with --markdown: one row for each stage's modules under S seconds")
    p.add_argument("--order", type=Path, metavar="JSON",
                   help="write each stage's seconds per module to JSON (tests/module_seconds.json)")
    a = p.parse_args(argv)
    missing = [str(f) for f in a.files if not f.is_file()]
    if missing:
        print(f"test_durations: no such file: {', '.join(missing)} (make test writes build/test-reports/)",
              file=sys.stderr)
        return 2
    rows = read(a.files)
    if a.order:
        a.order.write_text(json.dumps(module_seconds(rows), indent=1, sort_keys=True) + "\n")
        return 0
    print(markdown(rows, a.fold_below) if a.markdown else text_report(rows, a.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
