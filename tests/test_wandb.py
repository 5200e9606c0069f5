"""trainer.wandb: an offline W&B run whose history holds the run's stats.jsonl values,
continued (same id, each step once) by a run stopped (SIGTERM) and resumed from its
checkpoint."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import time

import _tiers
import pytest
from _dist import _worker, rank_context, run_gloo
from _wandb import history

from areal_mcore.cli import main
from areal_mcore.config import ConfigError, load_config
from areal_mcore.data.tiny_assets import TinyAssetsConfig, build_tiny_assets
from areal_mcore.net import free_port
from areal_mcore.trainer.stats import _scalar

STEPS = 4


def test_wandb_is_off_by_default_and_modes_are_validated():
    cfg = load_config("configs/tiny_cpu.yaml")
    assert cfg.trainer.wandb.mode == "disabled" and not cfg.trainer.wandb.enabled
    with pytest.raises(ConfigError, match=r"trainer.wandb.mode='local' is not allowed; choose one of "
                                          r"\['disabled', 'offline', 'online'\]"):
        load_config("configs/tiny_cpu.yaml", ["trainer.wandb.mode=local"])
    cfg = load_config("configs/tiny_cpu.yaml", ["trainer.wandb.mode=offline", "trainer.wandb.tags=[a,b]",
                                                "trainer.wandb.entity=team"])
    assert (cfg.trainer.wandb.tags, cfg.trainer.wandb.entity) == (["a", "b"], "team")


def test_without_wandb_installed_the_error_names_the_extra(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    assert main(["train", "--config", "configs/tiny_cpu.yaml", "trainer.wandb.mode=offline"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("areal-mcore train: error: trainer.wandb.mode=offline needs the wandb package, which is "
                   "optional: pip install 'areal-mcore[wandb]' (or set trainer.wandb.mode=disabled)")


def _ppo_worker(rank, world, overrides):
    from areal_mcore.trainer.ppo import train

    return train(load_config(None, overrides))


@pytest.mark.slow
@pytest.mark.server
def test_offline_run_history_matches_stats_and_a_resumed_run_logs_each_step_once(tmp_path, monkeypatch):
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):  # nothing outside tmp_path
        monkeypatch.setenv(var, str(tmp_path / var.lower()))
    monkeypatch.setenv("WANDB_MODE", "offline")  # belt and braces: never the network
    assets = build_tiny_assets(TinyAssetsConfig(out_dir=str(tmp_path / "assets"), n_train=32, n_test=4,
                                                hidden_size=32, intermediate_size=64, num_layers=1))
    overrides = [
        "experiment_name=wb", f"model_path={assets['model']}", f"dataset.path={assets['train']}",
        f"eval_dataset.path={assets['test']}", "trainer.eval_freq=2",
        "actor.vocab_divisible_by=8", "actor.mb_spec.max_tokens_per_mb=512", "actor.optimizer.lr=1e-3",
        "server.model_path=${model_path}", "server.dtype=float32", "server.context_length=256",
        "weight_sync.dtype=float32", "weight_sync.master_address=127.0.0.1", "reward.num_workers=1",
        "rollout.max_new_tokens=8", "rollout.n_samples=2", "trainer.batch_size=2",
        f"trainer.total_steps={STEPS}", "trainer.save_freq=1", f"trainer.log_dir={tmp_path / 'runs'}",
        "trainer.progress=false", "trainer.wandb.mode=offline", "trainer.wandb.project=tiny",
        "trainer.wandb.tags=[ci]", "ppo.reward_bias=-0.5", "ppo.reward_scaling=10.0"]
    run_dir = tmp_path / "runs" / "wb"
    stats = run_dir / "stats.jsonl"
    # Stopped as Slurm preempts (SIGTERM: checkpoint, then exit) once 2 steps are logged.
    ctx, port = rank_context(), free_port()
    queue = ctx.Queue()  # held here: the child unpickles it after start() returns
    proc = ctx.Process(target=_worker, args=(0, 1, port, _ppo_worker, (overrides,), queue,
                                                   _tiers.marks(), dict(os.environ)))
    proc.start()
    deadline = time.time() + 600
    while not (stats.exists() and len(stats.read_text().splitlines()) >= 2):
        assert time.time() < deadline
        assert proc.exitcode is None, queue.get(timeout=10)[2]  # the run's traceback
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGTERM)
    proc.join(timeout=300)
    assert proc.exitcode == 0
    stopped_at = len(stats.read_text().splitlines())
    assert 2 <= stopped_at < STEPS
    ids_before, _ = history(run_dir)
    assert len(set(ids_before)) == 1

    resumed = run_gloo(_ppo_worker, 1, overrides)[0]
    assert resumed[0]["step"] == stopped_at + 1  # from the checkpoint, not from scratch
    ids, rows = history(run_dir)
    assert len(ids) == 2 and set(ids) == set(ids_before)  # the same W&B run, continued
    steps = [r["step"] for r in map(json.loads, stats.read_text().splitlines())]
    assert steps == list(range(1, STEPS + 1))
    logged = [r for r in rows if "train/loss" in r]
    assert [r["_step"] for r in logged] == steps  # each step once, in order, across both attempts
    for want, got in zip(map(json.loads, stats.read_text().splitlines()), logged):
        assert got["rollout/accuracy"] == want["rollout/accuracy"]
        assert got["train/loss"] == pytest.approx(_scalar(want["train/loss"]), rel=1e-12)
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert [r["_step"] for r in rows if "eval/accuracy" in r] == [e["step"] for e in evals] == [0, 2, 4]
    # curves.png at the end of each attempt, as a W&B image (its metadata in the history row).
    assert [r["_step"] for r in rows if r.get("curves/_type") == "image-file"] == [stopped_at, STEPS]
