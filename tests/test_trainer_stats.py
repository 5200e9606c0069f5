"""The trainer's reporting helpers: FLOPs per step, MFU, phase times and trace, resume."""

from __future__ import annotations

import json

import pytest
import torch

from areal_mcore.model.args import ModelArgs
from areal_mcore.trainer import stats as S
from areal_mcore.trainer.config import TrainerConfig


def test_train_flops_count_every_matmul_weight_of_the_real_model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hf = Qwen2Config(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(hf)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    args = ModelArgs.from_hf(hf)
    # One token of one sequence, forward only: 2 FLOPs per weight + the 1-token attention.
    assert S.train_flops(args, [1], forward_passes=1) == 2 * linear + 2 * 3 * 64
    # Attention grows with the square of each sequence, weights with the tokens.
    two = S.train_flops(args, [8, 8], forward_passes=3)
    one = S.train_flops(args, [16], forward_passes=3)
    assert one - two == 3 * 2 * 3 * 64 * (16**2 - 2 * 8**2)


def test_mfu_divides_by_the_gpus_peak_and_is_absent_on_cpu(monkeypatch):
    assert S.mfu(1e12, 1.0, 1) is None or torch.cuda.is_available()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    assert S.mfu(989e12, 2.0, 1) == pytest.approx(0.5)
    assert S.mfu(989e12, 1.0, 4) == pytest.approx(0.25)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Some GPU")
    assert S.mfu(989e12, 1.0, 1) is None


def test_phases_sum_per_step_and_the_open_trace_parses(tmp_path):
    phases = S.Phases(tmp_path / "trace.json")
    for _ in range(2):
        with phases("train"):
            pass
    with phases("sync", version=1):
        pass
    times = phases.take()
    assert set(times) == {"time/train_s", "time/sync_s"} and phases.take() == {}
    phases.close()
    events = json.loads((tmp_path / "trace.json").read_text().rstrip().rstrip(",") + "]")
    assert [e["name"] for e in events] == ["train", "train", "sync"] and events[2]["args"] == {"version": 1}


def test_a_resumed_logger_drops_what_the_killed_run_logged_after_its_checkpoint(tmp_path):
    cfg = TrainerConfig(total_steps=5, batch_size=1, tensorboard=False, progress=False)
    (tmp_path / "stats.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3)))
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (0, 2)))
    S.RunLogger(cfg, tmp_path, enabled=True, start_step=2)  # resumed from the step-2 checkpoint
    assert [json.loads(x)["step"] for x in (tmp_path / "stats.jsonl").read_text().splitlines()] == [1, 2]
    # step 2's eval runs again right after the resume
    assert [json.loads(x)["step"] for x in (tmp_path / "eval.jsonl").read_text().splitlines()] == [0]


def test_a_fresh_run_sets_an_earlier_runs_rows_aside_instead_of_appending(tmp_path):
    cfg = TrainerConfig(total_steps=5, batch_size=1, tensorboard=False, progress=False)
    (tmp_path / "stats.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2)))
    (tmp_path / "eval.jsonl").write_text(json.dumps({"step": 0}) + "\n")
    S.RunLogger(cfg, tmp_path, enabled=True, start_step=0)  # no checkpoint: starts at step 1
    assert not (tmp_path / "stats.jsonl").exists() and not (tmp_path / "eval.jsonl").exists()
    (aside,) = tmp_path.glob("stats.before-*.jsonl")
    assert [json.loads(x)["step"] for x in aside.read_text().splitlines()] == [1, 2]
    assert len(list(tmp_path.glob("eval.before-*.jsonl"))) == 1
