"""The tiny run's learning over seeds: one PPO run per (backend, seed) from make run's SFT
warm-up, then the table the README reports (held-out gain at the last step, how far each
seed ends below its own peak, PPO wall time).

``.venv/bin/python tools/seed_table.py [--task boba|tool] [--backends vllm embedded]
[--seeds 1 2 3] [--out runs/seeds] [--report] [overrides ...]``

``--task tool``: the tiny tool-use task's (make run-tool, configs/tiny_tool_cpu.yaml)
instead of make run's.

A seed S sets ``seed``, ``rollout.seed`` and ``server.seed`` to S. Overrides
(``key=value``) go to every PPO run, e.g. ``actor.optimizer.lr=3e-4`` for a sweep
point. ``--report`` only reads the runs already under ``--out``. The assets and SFT model
are make run's (``runs/tiny-cpu``), built as scripts/quickstart.sh builds them if missing.
Runs go one after another: each wants both cores, and its PPO time is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from areal_mcore.run_dir import RunDir, read_jsonl
from areal_mcore.trainer.stats import trajectory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASKS = {"boba": ("configs/tiny_cpu.yaml", "tiny-cpu"), "tool": ("configs/tiny_tool_cpu.yaml", "tiny-tool")}
CONFIG, EXPERIMENT = TASKS["boba"]


def _cli(*args: str, env: dict | None = None) -> None:
    subprocess.run([sys.executable, "-m", "areal_mcore.cli", *args], cwd=ROOT, check=True, env=env)


def warm_up() -> None:
    """make run's assets and SFT model (scripts/quickstart.sh's first two steps)."""
    task = next(t for t, (config, _) in TASKS.items() if config == CONFIG)
    if not os.path.isfile(os.path.join(ROOT, "runs", EXPERIMENT, "assets/model/config.json")):
        subprocess.run([sys.executable, "-m", "areal_mcore.data.tiny_assets", "--task", task,
                        "--out", f"runs/{EXPERIMENT}/assets"], cwd=ROOT, check=True)
    _cli("sft", "--config", CONFIG, "--if-changed")


def run(out: str, backend: str, seed: int, overrides: list[str]) -> None:
    """One PPO run into ``out/<backend>/seed_<seed>``; its wall time in ``ppo_time.json``."""
    log_dir = _log_dir(out, backend, seed)
    server = ["server.backend=" + backend] + (["server.vllm.enforce_eager=true"] if backend == "vllm" else [])
    start = time.monotonic()
    # seed: the actor's initialisation and the prompt order; rollout.seed: the samples (and
    # the evals', rollout.seed + 1); server.seed: the servers' own generators
    seeds = [f"seed={seed}", f"rollout.seed={seed}", f"server.seed={seed}"]
    _cli("train", "--overwrite", "--config", CONFIG, *seeds, f"trainer.log_dir={log_dir}",
         "trainer.progress=false", *server, *overrides,
         env={"OMP_NUM_THREADS": "1", **os.environ})  # as make run's PPO (scripts/quickstart.sh says why)
    with open(log_dir / "ppo_time.json", "w") as f:
        json.dump({"ppo_s": time.monotonic() - start, "overrides": overrides}, f)


def _log_dir(out: str, backend: str, seed: int) -> Path:
    """One run's trainer.log_dir: its run directory (below) and ppo_time.json."""
    return Path(out, backend, f"seed_{seed}")


def _run_dir(out: str, backend: str, seed: int) -> Path:
    return _log_dir(out, backend, seed) / EXPERIMENT


def summary(out: str, backend: str, seeds: list[int]) -> dict | None:
    rows = []
    for seed in seeds:
        timing = _log_dir(out, backend, seed) / "ppo_time.json"
        if not timing.is_file():  # not run (yet), or did not finish
            continue
        acc = [e["eval/accuracy"] for e in read_jsonl(_run_dir(out, backend, seed) / "eval.jsonl")]
        ppo_s = json.loads(timing.read_text())["ppo_s"]
        rows.append({"seed": seed, "first": acc[0], "last": acc[-1], "peak": max(acc), "gain": acc[-1] - acc[0],
                     "below_peak": max(acc) - acc[-1], "ppo_s": ppo_s, "curve": acc})
    if not rows:
        return None
    gains = [r["gain"] for r in rows]
    return {"backend": backend, "seeds": rows, "gain_min": min(gains), "gain_median": statistics.median(gains),
            "gain_max": max(gains), "below_peak_max": max(r["below_peak"] for r in rows),
            "ppo_s_median": statistics.median(r["ppo_s"] for r in rows)}


def markdown(tables: list[dict]) -> str:
    lines = ["| backend | seed | held-out, step 0 -> last | gain | below own peak | PPO |",
             "|---|---|---|---|---|---|"]
    for t in tables:
        for r in t["seeds"]:
            lines.append(f"| {t['backend']} | {r['seed']} | {r['first']:.3f} -> {r['last']:.3f} | "
                         f"{r['gain']:+.3f} | {r['below_peak']:.3f} | {r['ppo_s'] / 60:.1f} min |")
        lines.append(f"| {t['backend']} | min / median / max | | {t['gain_min']:+.3f} / {t['gain_median']:+.3f} / "
                     f"{t['gain_max']:+.3f} | max {t['below_peak_max']:.3f} | median {t['ppo_s_median'] / 60:.1f} min |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--task", choices=sorted(TASKS), default="boba")
    p.add_argument("--backends", nargs="+", default=["vllm", "embedded"], choices=["vllm", "embedded"])
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    p.add_argument("--out", default="runs/seeds")
    p.add_argument("--report", action="store_true", help="only read the runs already under --out")
    p.add_argument("--trajectory", action="store_true", help="also print each run's trajectory")
    args, overrides = p.parse_known_args()
    global CONFIG, EXPERIMENT
    CONFIG, EXPERIMENT = TASKS[args.task]
    args.out = os.path.abspath(args.out)
    if not args.report:
        warm_up()
        for backend in args.backends:
            for seed in args.seeds:
                run(args.out, backend, seed, overrides)
    tables = [t for t in (summary(args.out, b, args.seeds) for b in args.backends) if t is not None]
    with open(os.path.join(args.out, "table.json"), "w") as f:
        json.dump(tables, f, indent=1)
    print(markdown(tables))
    for t in tables if args.trajectory else []:
        backend = t["backend"]
        for seed in (r["seed"] for r in t["seeds"]):
            run_dir = _run_dir(args.out, backend, seed)
            print(f"\n{backend}, seed {seed}:\n" + trajectory(RunDir(run_dir).stats_rows(),
                                                                read_jsonl(run_dir / "eval.jsonl")))


if __name__ == "__main__":
    main()
