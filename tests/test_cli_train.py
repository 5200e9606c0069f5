"""`areal-mcore train/sft`: help and config errors, before any process group starts."""

from __future__ import annotations

import pytest

from areal_mcore import cli
from areal_mcore.cli import main
from areal_mcore.model.adapter import WeightMismatchError


def test_train_help_names_the_config_and_overrides(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "--config" in out and "a.b.c=value" in out and "torchrun" in out


@pytest.mark.parametrize("command", ["train", "sft"])
def test_a_misspelt_override_names_the_nearest_key(command, capsys):
    assert main([command, "--config", "configs/tiny_cpu.yaml", "actor.lrr=1"]) == 2
    err = capsys.readouterr().err
    # the typed section's key first, then the other section's with that leaf
    assert "unknown config key 'actor.lrr'; did you mean 'actor.optimizer.lr' or 'sft.lr'?" in err, err


def test_a_missing_config_file_is_named(capsys):
    assert main(["train", "--config", "configs/nope.yaml"]) == 2
    assert "config file not found: configs/nope.yaml" in capsys.readouterr().err


def test_the_shipped_configs_load():
    from areal_mcore.config import load_config

    cfg = load_config("configs/tiny_cpu.yaml")
    assert cfg.server.model_path == cfg.model_path == "runs/tiny-cpu/sft_model"
    assert cfg.ppo.reward_norm.group_size == cfg.rollout.n_samples
    for name in ("boba_1.5b", "boba_7b", "boba_32b_ppo", "qwen3_8b", "qwen3_30b_a3b", "llama3_8b"):
        boba = load_config(f"configs/{name}.yaml")
        # the recipe's numbers (docs/recipe.md) where every PPO config must agree
        assert (boba.trainer.batch_size, boba.rollout.n_samples, boba.rollout.max_new_tokens) == (512, 16, 27648)
        assert boba.ppo.reward_norm.group_size == boba.rollout.n_samples
        assert (boba.ppo.reward_bias, boba.ppo.reward_scaling, boba.actor.optimizer.lr) == (-0.5, 10.0, 2e-5)
        assert boba.server.model_path == boba.model_path and boba.trainer.mode == "async"
    sft = load_config("configs/boba_32b_sft.yaml")
    assert sft.sft.base_model == sft.model_path and sft.dataset.format == "messages"
    assert load_config("configs/boba_32b_ppo.yaml").model_path == sft.sft.output_dir


@pytest.mark.parametrize("error, user", [(WeightMismatchError("ckpt lacks x: is it another model?"), True),
                                         (FileNotFoundError("no such folder: pass another"), True),
                                         (KeyError("a bug's missing key"), False)])
def test_cli_reports_user_errors_in_one_line_and_lets_bugs_raise(monkeypatch, capsys, error, user):
    def fail(a):
        raise error

    monkeypatch.setattr(cli, "run_plan", fail)
    if not user:  # a bug keeps its traceback
        with pytest.raises(type(error)):
            cli.main(["plan", "--config", "configs/tiny_cpu.yaml"])
        return
    assert cli.main(["plan", "--config", "configs/tiny_cpu.yaml"]) == 2
    assert capsys.readouterr().err == f"areal-mcore plan: error: {error}\n"
