"""On a tiny SFT model (built once here): `areal-mcore eval` on a run's exported model,
with the run's config, data and sampling, reproduces the run's own last held-out accuracy
(issue 21: the eval once appended boba's instruction to prompts that already had one and
scored 0.07 where the run said 0.51); and `areal-mcore filter difficulty --model` samples
k per problem, drops exactly the problems solved k of k, and resumes after a kill."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from areal_mcore.data.tiny_assets import TinyAssetsConfig, build_tiny_assets

pytestmark = pytest.mark.server

REPO = Path(__file__).parents[1]


def _cli(*args: str, timeout: int = 600) -> str:
    proc = subprocess.run([sys.executable, "-W", "ignore", "-m", "areal_mcore.cli", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(assets, the run's config file, its SFT model): make run's recipe, CI-sized."""
    tmp_path = tmp_path_factory.mktemp("tiny")
    assets = build_tiny_assets(TinyAssetsConfig(out_dir=str(tmp_path / "assets"), n_train=512, n_test=24))
    config = tmp_path / "run.yaml"  # configs/tiny_cpu.yaml's shape, CI-sized
    config.write_text(f"""experiment_name: agree
seed: 1
model_path: {tmp_path / 'sft_model'}
actor:
  vocab_divisible_by: 8
  mb_spec: {{max_tokens_per_mb: 2048}}
  optimizer: {{lr: 1.0e-4, eps: 1.0e-5}}
ppo:
  reward_bias: -0.5
  reward_scaling: 10.0
dataset: {{path: {assets['train']}}}
eval_dataset: {{path: {assets['test']}}}
rollout: {{max_new_tokens: 16, n_samples: 4, temperature: 1.0}}
server: {{model_path: '${{model_path}}', dtype: float32, context_length: 256}}
weight_sync: {{dtype: float32, master_address: 127.0.0.1}}
reward: {{num_workers: 1}}
trainer: {{total_steps: 1, batch_size: 4, eval_freq: 1, log_dir: {tmp_path / 'runs'}, progress: false}}
sft: {{base_model: {assets['model']}, output_dir: {tmp_path / 'sft_model'}, steps: 80, batch_size: 32, lr: 3.0e-3}}
""")
    _cli("sft", "--config", str(config))
    return assets, config, tmp_path / "sft_model"


@pytest.mark.slow
def test_eval_of_the_exported_model_matches_the_runs_final_eval_accuracy(tiny):
    assets, config, _ = tiny
    tmp_path = config.parent
    _cli("train", "--config", str(config))
    run_dir = tmp_path / "runs" / "agree"
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 1]
    run_acc = evals[-1]["eval/accuracy"]
    assert evals[-1]["eval/n_samples"] == 24 * 4
    # A model that solves nothing (or everything) would agree under any prompt.
    assert 0.1 < run_acc < 0.95, evals

    report = tmp_path / "eval.json"
    out = _cli("eval", "--config", str(config), "--model", str(run_dir / "hf" / "step_1"), "--model-kind", "rl",
               "--n-samples", "4", "--out", str(report))
    assert "prompts as in training" in out
    row = json.loads(report.read_text())["datasets"][0]
    assert row["problems"] == 24 and row["samples"] == 96
    print(f"run's final eval/accuracy {run_acc:.3f}; areal-mcore eval pass@1 {row['pass@1']:.3f}")
    assert abs(row["pass@1"] - run_acc) <= 0.05
    # boba's instruction on top of the rows' own (the old default) is a different prompt:
    # opt-in only, and reported as a difference.
    out = _cli("eval", "--config", str(config), "--model", str(run_dir / "hf" / "step_1"), "--model-kind", "rl",
               "--n-samples", "4", "--prompt-suffix",
               "Please reason step by step, and enclose your final answer in \\boxed{}.", "--out", str(report))
    assert "DIFFER from training" in out
    changed = json.loads(report.read_text())
    assert changed["prompt_changes"] and changed["datasets"][0]["pass@1"] != row["pass@1"]
    print(f"with boba's instruction added: pass@1 {changed['datasets'][0]['pass@1']:.3f}")


def _score(completions: list[str], solutions: list[list[str]]) -> list[float]:
    from areal_mcore.reward.pool import RewardPool, RewardPoolConfig

    with RewardPool(RewardPoolConfig(num_workers=1)) as pool:
        return pool.score(completions, solutions)


@pytest.mark.slow
def test_difficulty_filter_samples_k_drops_the_k_of_k_solved_and_resumes_after_a_kill(tiny, tmp_path):
    assets, _, model = tiny
    lines = Path(assets["train"]).read_text().splitlines()[:40]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(line + "\n" for line in lines))
    out = tmp_path / "kept.jsonl"
    samples = Path(str(out) + ".samples.jsonl")
    # Near-greedy sampling, so that both solved-8/8 and other problems exist in 40.
    args = [sys.executable, "-W", "ignore", "-m", "areal_mcore.cli", "filter", "difficulty", "--model", str(model),
            "--data", str(data), "--k", "8", "--max-new-tokens", "16", "--context-length", "256", "--dtype",
            "float32", "--temperature", "0.1", "--chunk", "4", "--workers", "1", "--out", str(out)]
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not (samples.exists() and len(samples.read_text().splitlines()) >= 8):
        assert time.time() < deadline and proc.poll() is None, proc.stderr.read()[-3000:] if proc.poll() else ""
        time.sleep(0.05)
    for pid in [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()
    before = samples.read_text()
    finished = [json.loads(x) for x in before.splitlines() if x.endswith("}")]
    assert 8 <= len(finished) < 40 and not out.exists()

    summary = json.loads(_cli(*args[5:]).strip().splitlines()[-1])
    rows = [json.loads(x) for x in samples.read_text().splitlines()]
    # Nothing finished was sampled again: the first attempt's rows are kept as they were.
    assert rows[:len(finished)] == finished and samples.read_text().startswith(before[:before.rfind("\n") + 1])
    assert sorted(r["line"] for r in rows) == list(range(1, 41))  # each problem once
    assert (summary["resumed"], summary["sampled"]) == (len(finished), 40 - len(finished))
    # The same samples scored directly: the filter drops exactly the 8-of-8 problems.
    gold = {i: json.loads(line)["solutions"] for i, line in enumerate(lines, 1)}
    direct = _score([c for r in rows for c in r["completions"]], [gold[r["line"]] for r in rows for _ in range(8)])
    assert all(len(r["completions"]) == 8 for r in rows)
    assert [r for row in rows for r in row["rewards"]] == direct
    solved = {r["line"] for i, r in enumerate(rows) if sum(direct[i * 8:(i + 1) * 8]) == 8}
    assert 0 < len(solved) < 40, solved
    assert out.read_text().splitlines() == [line for i, line in enumerate(lines, 1) if i not in solved]
    assert summary == {"problems": 40, "kept": 40 - len(solved), "dropped_solved": len(solved), "bad_rows": 0,
                       "sampled": 40 - len(finished), "resumed": len(finished)}
