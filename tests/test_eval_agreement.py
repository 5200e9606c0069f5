"""`areal-mcore eval` on a run's exported model, with the run's config, data and sampling,
reproduces the run's own last held-out accuracy (issue 21: the eval once appended boba's
instruction to prompts that already had one and scored 0.07 where the run said 0.51)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from areal_mcore.data.tiny_assets import TinyAssetsConfig, build_tiny_assets

REPO = Path(__file__).parents[1]


def _cli(*args: str, timeout: int = 600) -> str:
    proc = subprocess.run([sys.executable, "-W", "ignore", "-m", "areal_mcore.cli", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
def test_eval_of_the_exported_model_matches_the_runs_final_eval_accuracy(tmp_path):
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
sft: {{base_model: {assets['model']}, output_dir: {tmp_path / 'sft_model'}, steps: 80, batch_size: 32}}
""")
    _cli("sft", "--config", str(config), "actor.optimizer.lr=3e-3")
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
