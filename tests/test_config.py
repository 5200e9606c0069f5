from pathlib import Path

import pytest

from areal_mcore.algo.config import NormConfig
from areal_mcore.config import ConfigError, ExperimentConfig, load_config

BOBA_7B = Path(__file__).parents[1] / "configs" / "boba_7b.yaml"


def test_boba_7b_yaml_loads_seed_numbers():
    cfg = load_config(BOBA_7B, [])
    assert isinstance(cfg, ExperimentConfig)
    assert cfg.actor.mb_spec.max_tokens_per_mb == 30720
    assert cfg.actor.optimizer.lr == pytest.approx(2e-5)
    assert cfg.actor.optimizer.eps == pytest.approx(1e-5)
    ppo = cfg.ppo
    assert (ppo.ppo_n_minibatches, ppo.eps_clip, ppo.behav_imp_weight_cap) == (4, 0.2, 5.0)
    assert (ppo.reward_bias, ppo.reward_scaling, ppo.discount, ppo.gae_lambda) == (-0.5, 10.0, 1.0, 1.0)
    assert ppo.reward_norm == NormConfig(mean_level="group", std_level="group", group_size=16)
    assert (ppo.adv_norm.mean_level, ppo.adv_norm.std_level) == ("batch", "batch")


def test_overrides_apply_in_order_and_parse_yaml_values():
    cfg = load_config(BOBA_7B, ["ppo.eps_clip=0.4", "ppo.c_clip=3", "ppo.reward_norm=null",
                                "ppo.eps_clip=0.3", "actor.optimizer.lr=1e-6"])
    assert cfg.ppo.eps_clip == 0.3
    assert cfg.ppo.c_clip == 3.0
    assert cfg.ppo.reward_norm is None
    assert cfg.actor.optimizer.lr == 1e-6


def test_unknown_override_key_names_nearest_valid_key():
    with pytest.raises(ConfigError) as e:
        load_config(BOBA_7B, ["ppo.eps_clp=0.1"])
    assert "'ppo.eps_clp'" in str(e.value) and "'ppo.eps_clip'" in str(e.value)


def test_unknown_key_in_wrong_section_suggests_full_path():
    # Every section with that leaf is named (a dict by leaf kept only the last one's).
    with pytest.raises(ConfigError, match=r"did you mean 'actor\.optimizer\.lr' or 'sft\.lr'\?"):
        load_config(BOBA_7B, ["lr=1e-5"])


def test_context_parallelism_needs_c_in_the_allocation():
    # c adds GPUs: a cp the allocation does not give would change the job's size unseen.
    with pytest.raises((ConfigError, ValueError), match=r"has c1 \(context parallelism\) but actor\.parallel\.cp=2: "
                                                        r"they must agree; set launch\.allocation="
                                                        r"'sglang:d16\+megatron:d8t2c2' \(c adds GPUs: d8 x t2 x c2 = "
                                                        r"32 GPUs\) or actor\.parallel\.cp=1"):
        load_config(BOBA_7B, ["actor.parallel.cp=2"])


def test_unknown_yaml_key_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(BOBA_7B.read_text().replace("  eps_clip: 0.2", "  eps_clipp: 0.2"))
    line = next(i for i, text in enumerate(bad.read_text().splitlines(), 1) if "eps_clipp" in text)
    with pytest.raises(ConfigError) as e:
        load_config(bad, [])
    assert f"{bad}:{line}" in str(e.value)
    assert "'ppo.eps_clip'" in str(e.value)


def test_wrong_type_names_key_and_expected_type():
    with pytest.raises(ConfigError) as e:
        load_config(BOBA_7B, ["actor.optimizer.lr=fast"])
    msg = str(e.value)
    assert "'actor.optimizer.lr'" in msg and "expects float" in msg and "'fast'" in msg


def test_wrong_type_of_optional_field_says_null_is_allowed():
    with pytest.raises(ConfigError, match=r"'ppo.c_clip' expects float or null"):
        load_config(BOBA_7B, ["ppo.c_clip=big"])


def test_invalid_choice_names_dotted_key_and_allowed_values():
    with pytest.raises(ConfigError) as e:
        load_config(BOBA_7B, ["ppo.reward_norm.mean_level=prompt"])
    assert "ppo.reward_norm.mean_level='prompt'" in str(e.value)
    assert "['group', 'batch', 'none']" in str(e.value)


def test_missing_required_value_says_how_to_set_it():
    with pytest.raises(ConfigError, match=r"'actor.mb_spec.max_tokens_per_mb'.*actor.mb_spec.max_tokens_per_mb="):
        load_config(None, ["experiment_name=x", "actor.optimizer.lr=1e-5"])


@pytest.mark.parametrize("override", ["ppo.eps_clip", "=3", "ppo..x=1"])
def test_malformed_override_is_a_config_error(override):
    with pytest.raises(ConfigError):
        load_config(BOBA_7B, [override])


def test_missing_file_and_non_mapping_yaml(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml", [])
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(tmp_path / "list.yaml", [])
    (tmp_path / "broken.yaml").write_text("a: [1,\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(tmp_path / "broken.yaml", [])


def test_dataclass_validation_without_loader():
    with pytest.raises(ValueError, match=r"std_level='pop'.*\['group', 'batch', 'none'\]"):
        NormConfig(mean_level="batch", std_level="pop")


TINY = Path(__file__).parents[1] / "configs" / "tiny_cpu.yaml"


def test_min_new_tokens_with_tokenizer_free_servers_is_refused_with_the_reason():
    with pytest.raises(ConfigError, match=r"rollout\.min_new_tokens=2 needs a tokenizer.*"
                                          r"server\.skip_tokenizer_init is true"):
        load_config(TINY, ["rollout.min_new_tokens=2"])
    cfg = load_config(TINY, ["rollout.min_new_tokens=2", "server.skip_tokenizer_init=false",
                             "server.backend=sglang"])
    assert cfg.rollout.sampling().min_new_tokens == 2


@pytest.mark.parametrize("overrides, why", [
    (["rollout.episode=areal_mcore.rollout.episodes.tool_use:Nope"],
     r"rollout\.episode='areal_mcore.rollout.episodes.tool_use:Nope' names no factory"),
    (["rollout.episode=no_such_module:Episode"], r"rollout\.episode='no_such_module:Episode' cannot be imported"),
    (["rollout.episode=areal_mcore.rollout.episodes.tool_use:ToolCalls", "rollout.episode_args.max_turn=2"],
     r"rollout\.episode_args=\{'max_turn': 2\} does not fit .*ToolCalls: got an unexpected keyword argument"),
    (["rollout.episode=areal_mcore.rollout.episodes.tool_use:ToolCalls", "rollout.episode_args.max_turns=0"],
     r"rollout\.episode_args=\{'max_turns': 0\} is refused by .*ToolCalls: max_turns=0 must be at least 1"),
])
def test_an_episode_that_cannot_be_built_is_refused_at_load_naming_the_key(overrides, why):
    with pytest.raises(ConfigError, match=why):
        load_config(TINY, overrides)


def test_pause_mode_takes_sglangs_three_modes_only():
    assert load_config(TINY, ["weight_sync.pause_mode=retract"]).weight_sync.pause_mode == "retract"
    with pytest.raises(ConfigError, match=r"weight_sync.pause_mode='inplace' is not allowed; choose one of \['abort', 'retract', 'in_place'\]"):
        load_config(TINY, ["weight_sync.pause_mode=inplace"])


def test_a_buckets_bound_must_stay_below_the_update_groups_timeout():
    assert load_config(TINY, ["weight_sync.bucket_timeout_s=60"]).weight_sync.bucket_timeout_s == 60
    with pytest.raises(ConfigError, match=r"weight_sync.bucket_timeout_s=600.0 .*below timeout_s \(600\)"):
        load_config(TINY, ["weight_sync.bucket_timeout_s=600"])


def test_reward_norm_group_size_mismatching_n_samples_is_refused_naming_both_keys():
    with pytest.raises(ConfigError) as e:
        load_config(BOBA_7B, ["ppo.reward_norm.group_size=8", "rollout.n_samples=16"])
    msg = str(e.value)
    assert "ppo.reward_norm.group_size=8" in msg and "rollout.n_samples=16" in msg


def test_reward_norm_group_size_null_follows_rollout_n_samples():
    cfg = load_config(BOBA_7B, ["ppo.reward_norm.group_size=null", "rollout.n_samples=12"])
    assert cfg.ppo.reward_norm.group_size == 12
    batch_only = load_config(BOBA_7B, ["ppo.reward_norm.mean_level=batch", "ppo.reward_norm.std_level=batch",
                                       "ppo.reward_norm.group_size=null", "rollout.n_samples=12"])
    assert batch_only.ppo.reward_norm.group_size is None  # not used at batch level


def test_loglinear_proximal_without_the_decoupled_loss_is_refused_with_the_reason():
    with pytest.raises(ConfigError) as e:
        load_config(BOBA_7B, ["ppo.use_decoupled_loss=false", "ppo.prox_logp_method=loglinear"])
    msg = str(e.value)
    assert "ppo.prox_logp_method='loglinear' needs use_decoupled_loss=true" in msg
    assert "behaviour" in msg
    assert load_config(BOBA_7B, ["ppo.prox_logp_method=loglinear"]).ppo.use_decoupled_loss  # boba: fine


@pytest.mark.parametrize("override", ["ppo.adv_norm.mean_level=group", "ppo.adv_norm.std_level=group",
                                      "rollout.temperature=0"])
def test_settings_the_training_maths_cannot_honour_are_refused(override):
    with pytest.raises(ConfigError, match=override.split(".", 1)[1].split("=")[0]):
        load_config(BOBA_7B, [override])


def test_negative_normalisation_eps_is_refused():
    with pytest.raises(ConfigError, match="ppo.reward_norm.eps"):
        load_config(BOBA_7B, ["ppo.reward_norm.eps=-1"])


# One bad value per section (and nested section): the message names the full dotted key
# once, where the dataclass that rejects it sits. The sections come from the schema, so a
# new section without a case here fails the coverage test below.
SECTION_CASES = {
    "actor": ("actor.dtype=float16", "actor.dtype"),
    "actor.mb_spec": ("actor.mb_spec.min_mbs=0", "actor.mb_spec.min_mbs"),
    "actor.optimizer": ("actor.optimizer.lr_scheduler=step", "actor.optimizer.lr_scheduler"),
    "actor.parallel": ("actor.parallel.first_stage_layers=2", "actor.parallel.first_stage_layers"),
    "ppo": ("ppo.c_clip=0.5", "ppo.c_clip"),
    "ppo.reward_norm": ("ppo.reward_norm.std_level=prompt", "ppo.reward_norm.std_level"),
    "ppo.adv_norm": ("ppo.adv_norm.eps=-1", "ppo.adv_norm.eps"),
    "ppo.overlong_penalty": ("ppo.overlong_penalty.buffer_len=0", "ppo.overlong_penalty.buffer_len"),
    "dataset": ("dataset.format=csv", "dataset.format"),
    "eval_dataset": ("eval_dataset.think=yes", "eval_dataset.think"),
    "rollout": ("rollout.n_samples=0", "rollout.n_samples"),
    "server": ("server.backend=tgi", "server.backend"),
    "server.vllm": ("server.vllm.weight_transfer_backend=gloo", "server.vllm.weight_transfer_backend"),
    "weight_sync": ("weight_sync.mode=bogus", "weight_sync.mode"),
    "reward": ("reward.timeout_s=0", "reward.timeout_s"),
    "trainer": ("trainer.mode=later", "trainer.mode"),
    "trainer.wandb": ("trainer.wandb.mode=loud", "trainer.wandb.mode"),
    "sft": ("sft.response_template=x", "sft.response_template"),
    "launch": ("launch.gpus_per_node=0", "launch.gpus_per_node"),
    "plan": ("plan.margin_gb=-1", "plan.margin_gb"),
    "doctor": ("doctor.checks=[gpus]", "doctor.checks"),
    "eval": ("eval={model_kind: rl, n_samples: 0}", "eval.n_samples"),  # model_kind is required
    "filter": ("filter={out: kept.jsonl, k: 0}", "filter.k"),  # and out
}


@pytest.mark.parametrize("section", sorted(SECTION_CASES))
def test_each_sections_validation_names_its_full_key_once(section):
    override, key = SECTION_CASES[section]
    with pytest.raises(ConfigError) as e:
        load_config(TINY, [override])
    msg = str(e.value)
    assert msg.startswith(key) and msg.count(key) == 1, msg
    assert f"{section}.{section}" not in msg, msg


def test_every_config_section_has_a_validation_case():
    from areal_mcore.config import _all_keys, _dataclass_of, _field_type

    sections = {k for k in _all_keys(ExperimentConfig) if _dataclass_of(_field_type(ExperimentConfig, k))}
    assert sections == set(SECTION_CASES)


def test_a_bad_list_item_names_the_item_and_the_element_type():
    with pytest.raises(ConfigError, match=r"override 'server.gpus=\[0, x\]': config key 'server.gpus\[1\]' expects int"):
        load_config(TINY, ["server.gpus=[0, x]"])


def test_the_servers_serve_model_path_unless_server_model_path_says_otherwise():
    assert load_config(TINY, ["server.model_path=null", "model_path=m"]).server.model_path == "m"
    assert load_config(TINY, ["server.model_path=other"]).server.model_path == "other"


def test_a_bogus_weight_sync_mode_is_reported_once_with_the_choices():
    with pytest.raises(ConfigError) as e:
        load_config(TINY, ["weight_sync.mode=bogus"])
    assert str(e.value) == "weight_sync.mode='bogus' is not allowed; choose one of ['distributed', 'disk']"


def test_a_vllm_option_with_another_backend_is_refused_naming_the_key_and_the_backend():
    # only the vLLM adapter reads server.vllm: with another engine the value would be lost
    with pytest.raises(ConfigError, match=r"^server\.vllm\.enforce_eager=True is a vLLM option, "
                                          r"but backend='sglang' starts no vLLM server"):
        load_config(TINY, ["server.backend=sglang", "server.vllm.enforce_eager=true"])
    assert load_config(TINY, ["server.backend=vllm", "server.vllm.enforce_eager=true"]).server.vllm.enforce_eager
    with pytest.raises(ConfigError, match=r"unknown config key 'server\.enforce_eager'; "
                                          r"did you mean 'server\.vllm\.enforce_eager'\?"):
        load_config(TINY, ["server.backend=vllm", "server.enforce_eager=true"])


def test_the_launch_allocation_follows_server_backend_when_unset():
    assert load_config(TINY, []).launch.allocation == "embedded:d1+megatron:d1"
    sglang = load_config(TINY, ["server.backend=sglang"])
    assert sglang.launch.allocation == "sglang:d1+megatron:d1"
    assert load_config(TINY, ["launch.stage=sft"]).launch.allocation == "megatron:d1"


def test_an_allocation_naming_another_backend_than_server_backend_is_refused_naming_both():
    with pytest.raises(ConfigError) as e:
        load_config(BOBA_7B, ["server.backend=embedded", "server.tp_size=1"])  # allocation: sglang:d16+...
    msg = str(e.value)
    assert "launch.allocation='sglang:d16+megatron:d8t2'" in msg and "server.backend='embedded'" in msg
    assert "embedded:d16" in msg  # the allocation that would agree


def test_algo_presets_set_the_published_keys_over_the_file_and_the_command_line_wins(capsys):
    """GSPO, DAPO and Dr.GRPO took 4-5 keys each, assembled from a table."""
    import dataclasses

    from areal_mcore.algo.presets import PRESETS
    from areal_mcore.cli import main

    dapo = load_config("configs/tiny_cpu.yaml", ["algo=dapo"])
    assert (dapo.ppo.eps_clip, dapo.ppo.eps_clip_high, dapo.ppo.loss_agg_mode) == (0.2, 0.28, "token-mean")
    assert dapo.rollout.dynamic_sampling and dapo.ppo.adv_norm is None
    assert (dapo.ppo.reward_norm.mean_level, dapo.ppo.reward_norm.std_level) == ("group", "group")
    # Over the file (tiny_cpu.yaml normalises by group std and batch advantages) ...
    dr = load_config("configs/tiny_cpu.yaml", ["algo=dr_grpo"])
    assert dr.ppo.reward_norm.std_level == "none" and dr.ppo.adv_norm is None
    assert dr.ppo.loss_agg_mode == "seq-mean-token-sum-norm"
    # ... under the command line, before or after algo=.
    for overrides in (["algo=gspo", "ppo.eps_clip=1e-3"], ["ppo.eps_clip=1e-3", "algo=gspo"]):
        gspo = load_config("configs/tiny_cpu.yaml", overrides)
        assert (gspo.ppo.eps_clip, gspo.ppo.eps_clip_high) == (1e-3, 4e-4)
        assert gspo.ppo.importance_sampling_level == "sequence"
    assert dataclasses.asdict(gspo)["algo"] == "gspo"  # the manifest's resolved config names it
    with pytest.raises(ConfigError, match=r"algo='grpo' is not a preset: one of \['dapo', 'dr_grpo', 'gspo'\]"):
        load_config("configs/tiny_cpu.yaml", ["algo=grpo"])
    assert set(PRESETS) == {"dapo", "gspo", "dr_grpo"}
    assert main(["plan", "--config", "configs/boba_7b.yaml", "algo=gspo", "ppo.eps_clip=1e-3"]) == 0
    assert ("algo=gspo: ppo.reward_norm.mean_level=group ppo.reward_norm.std_level=group ppo.adv_norm=null "
            "ppo.importance_sampling_level=sequence ppo.eps_clip=0.001 ppo.eps_clip_high=0.0004 "
            "ppo.loss_agg_mode=seq-mean-token-mean") in capsys.readouterr().out
