"""`areal-mcore plan`: the boba configs fit 80 GB, a config that cannot fit is refused
before anything starts (a micro-batch too small for the longest sequence included), the
arithmetic follows megatron's layout, and context parallelism is planned and offered."""

from __future__ import annotations

import json

import pytest
import torch

from areal_mcore.cli import main
from areal_mcore.config import load_config
from areal_mcore.plan import TrainerShape, make_plan, trainer_plan
from areal_mcore.plan.architectures import resolve_architecture
from areal_mcore.plan.concurrency import footprint, sequences_per_server
from areal_mcore.plan.lengths import Lengths, dump_lengths
from areal_mcore.plan.memory import GiB, server_plan, stage_params
from areal_mcore.plan.planner import server_shape

BOBA = ["boba_1.5b", "boba_7b", "boba_32b_ppo", "boba_32b_sft", "qwen3_8b", "qwen3_30b_a3b", "llama3_8b",
        "boba_7b_cp", "boba_32b_ppo_cp"]
# boba_1.5b before it held the longest sequence: 16384-token micro-batches, no recompute.
BOBA_1_5B_BEFORE = ["actor.recompute=false", "actor.mb_spec.max_tokens_per_mb=16384"]
TOO_BIG = ["actor.recompute=false", "actor.parallel.sequence_parallel=false"]


@pytest.mark.parametrize("name", BOBA)
def test_plan_boba_configs_fit_80gb(name, capsys):
    assert main(["plan", "--config", f"configs/{name}.yaml", "--gpu", "h100"]) == 0
    out = capsys.readouterr().out
    assert "verdict: fits" in out and "trainer stage 0" in out and "peak trainer rank" in out


def test_plan_warns_when_an_override_leaves_the_allocation_at_another_tp(capsys):
    """`plan ... actor.parallel.tp=4` on a t2 allocation reported "trainer DP 1 ... fits"
    and said nothing, while the Slurm launcher would run the allocation's t2."""
    assert main(["plan", "--config", "configs/boba_7b.yaml", "--gpu", "h100"]) == 0
    assert "warning" not in capsys.readouterr().out
    assert main(["plan", "--config", "configs/boba_7b.yaml", "--gpu", "h100", "actor.parallel.tp=4"]) == 0
    out = capsys.readouterr().out
    assert ("warning: launch.allocation=sglang:d16+megatron:d8t2 gives the trainer t2 p1, but actor.parallel is "
            "tp=4 pp=1: planned at DP 1") in out and "set launch.allocation=sglang:d16+megatron:d4t4" in out, out
    main(["plan", "--config", "configs/boba_7b.yaml", "--json", "actor.parallel.tp=3"])
    (warning,) = json.loads(capsys.readouterr().out)["warnings"]
    assert "its 16 trainer GPUs do not tile at tp=3 pp=1" in warning


def test_plan_32b_without_recompute_and_sp_does_not_fit_and_names_the_fixes(capsys):
    assert main(["plan", "--config", "configs/boba_32b_ppo.yaml", *TOO_BIG]) == 1
    out = capsys.readouterr().out
    assert "verdict: does NOT fit" in out
    assert "fix (trainer): actor.recompute=true ->" in out
    assert "actor.parallel.sequence_parallel=true ->" in out
    assert main(["plan", "--config", "configs/boba_32b_ppo.yaml", "--json", *TOO_BIG]) == 1
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] is False and plan["peak_rank"] == "trainer stage 0"  # 4 micro-batches in flight
    fixes = {tuple(f["overrides"]): f for f in plan["fixes"]}
    both = fixes[("actor.recompute=true", "actor.parallel.sequence_parallel=true")]
    assert both["fits"] and both["trainer_peak_gib"] < plan["peak_gib"] / 4
    assert [r["rank"] for r in plan["trainer"]] == [f"trainer stage {s}" for s in range(4)]


@pytest.mark.parametrize("command", ["train", "sft"])
def test_train_refuses_a_config_that_cannot_fit_before_starting(command, capsys, monkeypatch):
    import areal_mcore.cli as cli

    monkeypatch.setattr(cli, "_init_distributed", lambda: pytest.fail("started despite the plan"))
    config = "configs/boba_32b_ppo.yaml" if command == "train" else "configs/boba_32b_sft.yaml"
    overrides = TOO_BIG if command == "train" else ["actor.recompute=false", "actor.parallel.tp=2",
                                                    "launch.allocation=megatron:d1p4t2"]
    assert main([command, "--config", config, *overrides]) == 2
    err = capsys.readouterr().err
    assert "refusing to start" in err and "--no-plan-check" in err and "fix (trainer)" in err


def test_no_plan_check_lets_the_run_start(monkeypatch):
    import areal_mcore.cli as cli

    class Started(Exception):
        pass

    def started():
        raise Started

    monkeypatch.setattr(cli, "_init_distributed", started)
    # The config's model folders exist on a cluster only; the path checks (issue 21) pass here.
    monkeypatch.setattr("areal_mcore.paths.check_run_paths", lambda cfg, command: None)
    with pytest.raises(Started):
        main(["train", "--config", "configs/boba_32b_ppo.yaml", "--no-plan-check", *TOO_BIG])


def test_slurm_launcher_refuses_before_any_server(monkeypatch, capsys):
    from areal_mcore.launcher import slurm

    monkeypatch.setattr(slurm, "Launcher", lambda *a, **k: pytest.fail("launcher built despite the plan"))
    assert slurm.main(["run", "--config", "configs/boba_32b_ppo.yaml", *TOO_BIG]) == 2
    assert "refusing to start" in capsys.readouterr().err


def test_tiny_cpu_config_passes_the_check():
    from areal_mcore.plan import refusal

    assert refusal(load_config("configs/tiny_cpu.yaml")) is None  # no model yet: not refused


def test_stage_params_sum_to_the_hf_parameter_count():
    # 7B at TP 1, PP 1 must count exactly the HF model's 7,615,616,512 parameters
    # (Qwen2-7B shapes; vocab 152064 is already a multiple of 128).
    args, _ = resolve_architecture(None, "DeepSeek-R1-Distill-Qwen-7B")
    assert stage_params(args, TrainerShape(), 0) == 7_615_616_512
    # TP 2 halves everything but the norms; PP 2 splits it into two stages that add up.
    two = TrainerShape(pp=2)
    assert stage_params(args, two, 0) + stage_params(args, two, 1) == 7_615_616_512
    norms = (2 * args.num_layers + 1) * args.hidden_size
    assert stage_params(args, TrainerShape(tp=2), 0) * 2 - norms == 7_615_616_512


def test_pipeline_stages_hold_pp_minus_stage_micro_batches():
    args, _ = resolve_architecture(None, "DeepSeek-R1-Distill-Qwen-32B")
    ranks = trainer_plan(args, TrainerShape(tp=8, pp=4, tokens_per_mb=30720))
    acts = [r.terms["activations"] for r in ranks]
    per_mb = acts[1] / 3
    assert acts[0] == pytest.approx(4 * per_mb, rel=1e-3) and acts[2] == pytest.approx(2 * per_mb, rel=1e-3)
    # The arithmetic: ~73 KB per token per layer without SP/recompute at TP 8.
    assert per_mb / 16 / 30720 == pytest.approx(71.7e3, rel=0.02)


def test_sequence_parallel_and_recompute_shrink_activations():
    args, _ = resolve_architecture(None, "DeepSeek-R1-Distill-Qwen-7B")
    base = dict(tp=2, tokens_per_mb=30720)
    act = {k: trainer_plan(args, TrainerShape(**base, **kw))[0].terms["activations"]
           for k, kw in {"none": {}, "sp": {"sequence_parallel": True}, "rc": {"recompute": True}}.items()}
    assert act["rc"] < act["sp"] < act["none"]


def test_uneven_split_moves_layers_off_the_first_stage():
    args, _ = resolve_architecture(None, "DeepSeek-R1-Distill-Qwen-32B")
    even = trainer_plan(args, TrainerShape(tp=8, pp=4, tokens_per_mb=30720, recompute=True))
    uneven = trainer_plan(args, TrainerShape(tp=8, pp=4, tokens_per_mb=30720, recompute=True,
                                             first_stage_layers=12, last_stage_layers=12))
    assert uneven[0].terms["weights"] < even[0].terms["weights"]
    assert uneven[1].terms["weights"] > even[1].terms["weights"]


def test_server_kv_capacity_follows_sglang_pool_sizing():
    cfg = load_config("configs/boba_7b.yaml")
    args, _ = resolve_architecture(cfg.model_path, None)
    s = server_plan(args, server_shape(cfg, 80 * GiB))
    # 28 layers x 4 KV heads x 128 x (K and V) x bf16 = 56 KiB per token on a TP-1 server.
    assert s["kv_bytes_per_token"] == 2 * 28 * 4 * 128 * 2
    pool = 0.9 * 80 * GiB - 7_615_616_512 * 2
    assert s["kv_tokens"] == int(pool // s["kv_bytes_per_token"])
    assert s["sequences_fit"] == s["kv_tokens"] // (1024 + 27648)
    # The config's concurrency is sized at expected lengths, past the worst case, and fits.
    planned = make_plan(cfg).server
    assert s["sequences_fit"] < planned["sequences_configured"] <= planned["sequences_fit_expected"]
    assert planned["fits"] and planned["recommended_groups"] == cfg.rollout.max_concurrent_rollouts


def test_slot_footprint_of_one_length_is_prompt_plus_half_with_uniform_spread():
    # A slot on responses of one length L holds p + U x L tokens: mean p + L/2, sd L/sqrt(12).
    mean, sd = footprint(Lengths((1200,), "one"), 100)
    assert mean == pytest.approx(700) and sd == pytest.approx(1200 / 12 ** 0.5)
    # b x 700 + 2 sqrt(b) x 346.4 <= 0.9 x 70,000 -> b = 81 (82 would overrun).
    assert sequences_per_server(Lengths((1200,), "one"), 100, 70_000, 0.1) == 81


def test_plan_lengths_from_a_rollout_dump_and_a_missing_one_named(tmp_path):
    dump = tmp_path / "rollouts"
    dump.mkdir()
    (dump / "step_1.jsonl").write_text("".join(json.dumps({"response_len": n}) + "\n" for n in (100, 30000)))
    assert dump_lengths(dump, 27648).tokens == (100, 27648)
    cfg = load_config("configs/boba_7b.yaml", [f"plan.lengths={dump}"])
    assert make_plan(cfg).server["lengths"].startswith("2 responses")
    with pytest.raises(FileNotFoundError, match="plan.lengths="):
        make_plan(load_config("configs/boba_7b.yaml", [f"plan.lengths={tmp_path / 'none'}"]))


def test_qwen3_30b_a3b_is_qwen3_8bs_recipe_and_its_plan_reads_ep_from_the_allocation():
    moe, dense = load_config("configs/qwen3_30b_a3b.yaml"), load_config("configs/qwen3_8b.yaml")
    # the algorithm is the boba recipe's, unchanged
    assert moe.ppo == dense.ppo and moe.actor.optimizer == dense.actor.optimizer and moe.dataset == dense.dataset
    assert (moe.rollout.n_samples, moe.rollout.max_new_tokens, moe.rollout.temperature, moe.trainer.batch_size) == (
        dense.rollout.n_samples, dense.rollout.max_new_tokens, dense.rollout.temperature, dense.trainer.batch_size)
    plan = make_plan(moe)
    assert plan.architecture == "plan/architectures.py:Qwen3-30B-A3B" and plan.dp == 8 and plan.fits
    peak = plan.peak
    # 16 of 128 experts and half of each (TP 2) per rank; the rest split over TP 2
    args, _ = resolve_architecture(None, "Qwen3-30B-A3B")
    experts = 48 * 16 * 3 * 2048 * 768 // 2
    assert peak.terms["weights"] == 2 * stage_params(args, TrainerShape(tp=2, ep=8), 0)
    assert stage_params(args, TrainerShape(tp=2, ep=8), 0) - stage_params(args, TrainerShape(tp=2, ep=16), 0) == experts // 2
    # expert-DP is d8 / e8 = 1: the experts' Adam moments are not sharded
    assert peak.terms["optimizer"] > 8.0 * experts and "(EP 8; their optimizer state over expert-DP 1)" in peak.notes["weights"]
    assert peak.total / GiB == pytest.approx(55.9, abs=0.05)


def test_an_moe_config_that_does_not_fit_is_offered_more_ep_with_the_allocations_e():
    ep2 = ["actor.parallel.ep=2", "launch.allocation=sglang:d8t2+megatron:d8t2e2"]
    plan = make_plan(load_config("configs/qwen3_30b_a3b.yaml", ep2))
    assert not plan.trainer_fits
    fixes = {tuple(f["overrides"]): f for f in plan.fixes}
    more_ep = ("actor.parallel.ep=4", "launch.allocation=sglang:d8t2+megatron:d8t2e4")
    assert fixes[more_ep]["fits"] and fixes[more_ep]["trainer_peak_gib"] < plan.peak.total / GiB
    assert make_plan(load_config("configs/qwen3_30b_a3b.yaml", [*ep2, *more_ep])).trainer_fits  # as printed
    # TP/PP fixes shrink d and keep e (it must still divide d)
    assert ("actor.parallel.tp=4", "launch.allocation=sglang:d8t2+megatron:d4t4e2") in fixes


def test_unknown_architecture_names_the_key():
    cfg = load_config("configs/boba_32b_ppo.yaml", ["plan.architecture=null"])
    with pytest.raises(ValueError, match="plan.architecture"):
        make_plan(cfg)


def _hf_parameter_count(config) -> int:
    """transformers' own count: the model built on the meta device (no memory, no weights)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("pp", [1, 2])
def test_stage_params_count_experts_routers_and_dense_layers_of_qwen3_moe_like_transformers(pp):
    from transformers import Qwen3MoeConfig

    from areal_mcore.model.args import ModelArgs

    # Qwen3-30B-A3B's shapes (its public config.json), and a variant with dense layers
    # (mlp_only_layers, decoder_sparse_step) whose MLP is intermediate_size wide.
    a3b = dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
               num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
               moe_intermediate_size=768, norm_topk_prob=True, vocab_size=151936, tie_word_embeddings=False,
               max_position_embeddings=40960)
    for extra in ({}, {"mlp_only_layers": [0, 5], "decoder_sparse_step": 2}):
        config = Qwen3MoeConfig(**a3b, **extra)
        args = ModelArgs.from_hf(config)
        total = _hf_parameter_count(config)
        if not extra:
            assert total == 30_532_122_624  # "30.5B" on the model card
        assert sum(stage_params(args, TrainerShape(pp=pp), s) for s in range(pp)) == total


def test_stage_params_count_qwen2_moes_shared_expert_like_transformers():
    from transformers import Qwen2MoeConfig

    from areal_mcore.model.args import ModelArgs

    # Qwen2-57B-A14B's shapes (its public config.json): 64 experts of 2560, a shared one of 20480.
    config = Qwen2MoeConfig(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                            num_key_value_heads=4, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=2560,
                            shared_expert_intermediate_size=20480, vocab_size=151936, tie_word_embeddings=False,
                            max_position_embeddings=131072)
    args = ModelArgs.from_hf(config)
    assert sum(stage_params(args, TrainerShape(pp=2), s) for s in range(2)) == _hf_parameter_count(config)


def test_trainer_plan_splits_experts_over_ep_and_their_optimizer_state_over_expert_dp():
    """EP=2 halves a rank's expert weights and grads; the distributed optimizer shards the
    experts over the expert-DP group (dp / ep ranks), so their fp32 state per rank stays."""
    from transformers import Qwen3MoeConfig

    from areal_mcore.model.args import ModelArgs
    from areal_mcore.plan.memory import trainer_rank

    args = ModelArgs.from_hf(Qwen3MoeConfig(
        hidden_size=2048, intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
        norm_topk_prob=True, vocab_size=151936, tie_word_embeddings=False, max_position_embeddings=40960))
    experts = 48 * 128 * 3 * 2048 * 768
    one, two = (stage_params(args, TrainerShape(dp=4, ep=ep), 0) for ep in (1, 2))
    assert one - two == experts // 2
    p1, p2 = (trainer_rank(args, TrainerShape(dp=4, ep=ep, dtype_bytes=2), 0).terms for ep in (1, 2))
    assert p1["weights"] - p2["weights"] == experts // 2 * 2 and p1["grads"] - p2["grads"] == experts // 2 * 4
    assert p1["optimizer"] == p2["optimizer"] and p1["main_params"] == p2["main_params"]


# ---------------------------------------------------------------- context parallelism

# Each 32k CP config and its CP-1 twin: the same 32,768-token micro-batch row on the same
# trainer GPUs, in one rank (d x cp ranks of DP) instead of split over cp.
CP_TWINS = {
    "boba_7b_cp": ["actor.parallel.cp=1", "actor.mb_spec.max_tokens_per_mb=32768",
                   "launch.allocation=sglang:d16+megatron:d8t2"],
    "boba_32b_ppo_cp": ["actor.parallel.cp=1", "actor.mb_spec.max_tokens_per_mb=32768",
                        "launch.allocation=sglang:d128t4+megatron:d16p4t8"],
}


@pytest.mark.parametrize("name", sorted(CP_TWINS))
def test_32k_cp_configs_fit_where_their_cp_1_twin_does_not_and_the_twin_is_offered_that_cp(name):
    cfg = load_config(f"configs/{name}.yaml")
    a, alloc = cfg.actor, cfg.launch.allocation
    cp = a.parallel.cp
    assert cp > 1 and not a.recompute and a.mb_spec.max_tokens_per_mb * cp == 32768
    plan = make_plan(cfg, 79.6)
    assert plan.fits and plan.cp == cp and plan.dp * cp in (8, 16) and plan.sequence_fits
    assert plan.peak.notes["activations"].startswith(f"{1 if cfg.actor.parallel.pp == 1 else 4} micro-batch(es) of "
                                                     f"{a.mb_spec.max_tokens_per_mb} tokens per CP rank")
    twin = make_plan(load_config(f"configs/{name}.yaml", CP_TWINS[name]), 79.6)
    assert not twin.trainer_fits and twin.sequence_fits  # activations, not the sequence
    assert twin.peak.total > 1.4 * plan.peak.total
    # The smallest cp that fits is offered, with the cap divided and the allocation's c,
    # on the same GPUs: exactly the shipped config; no larger cp after it.
    offered = [f for f in twin.fixes if any(o.startswith("actor.parallel.cp=") for o in f["overrides"])]
    assert offered[-1]["overrides"] == [f"actor.parallel.cp={cp}", f"actor.mb_spec.max_tokens_per_mb={a.mb_spec.max_tokens_per_mb}",
                                        f"launch.allocation={alloc}"]
    assert offered[-1]["fits"] and not any(f["fits"] for f in offered[:-1])
    assert "keeps its" in offered[-1]["note"] and offered[-1]["trainer_peak_gib"] == round(plan.peak.total / GiB, 1)


def test_a_micro_batch_that_cannot_hold_the_longest_sequence_is_offered_cp(capsys):
    """boba_1.5b as it was: 16384-token micro-batches and responses of up to 27,648 tokens:
    the allocator would refuse the first truncated response mid-run; the plan refuses it
    before, and offers CP 2 (the row holds 28,672 tokens, 14,336 per rank, on the same 8
    GPUs) or a larger cap with recompute (what the config now has)."""
    assert main(["plan", "--config", "configs/boba_1.5b.yaml", "--gpu", "h100", *BOBA_1_5B_BEFORE]) == 1
    out = capsys.readouterr().out
    assert ("a truncated response alone (27649 tokens with a one-token prompt, padded) does NOT fit a micro-batch "
            "(max_tokens_per_mb x cp = 16384 x 1 = 16384 tokens") in out
    cp2 = ("actor.parallel.cp=2 actor.mb_spec.max_tokens_per_mb=14336 launch.allocation=sglang:d8+megatron:d4c2 -> "
           "trainer peak")
    assert cp2 in out and "fits (the trainer keeps its 8 GPUs: DP 8 -> 4 x CP 2" in out.split(cp2)[1].splitlines()[0]
    assert "actor.recompute=true actor.mb_spec.max_tokens_per_mb=28672 ->" in out
    assert "actor.parallel.cp=4" not in out  # cp 2 fits: no larger cp
    fixed = load_config("configs/boba_1.5b.yaml", [*BOBA_1_5B_BEFORE, "actor.parallel.cp=2",
                                                   "actor.mb_spec.max_tokens_per_mb=14336",
                                                   "launch.allocation=sglang:d8+megatron:d4c2"])
    assert make_plan(fixed, 79.6).trainer_fits
    # A DP that cannot shrink: c adds GPUs, and the fix says so.
    one = make_plan(load_config("configs/boba_1.5b.yaml", [*BOBA_1_5B_BEFORE,
                                                           "launch.allocation=sglang:d8+megatron:d1"]), 79.6)
    (fix,) = [f for f in one.fixes if "actor.parallel.cp=2" in f["overrides"]]
    assert "launch.allocation=sglang:d8+megatron:d1c2" in fix["overrides"]
    assert fix["note"].startswith("the trainer needs 2 GPUs (was 1)")


def test_a_row_short_of_the_longest_prompt_plus_response_is_warned_about_with_the_fixes():
    """Prompts seldom reach trainer.max_prompt_tokens: a row that holds a truncated response
    but not max_prompt_tokens + max_new_tokens still fits, with a warning and the fixes."""
    plan = make_plan(load_config("configs/boba_7b.yaml", ["actor.mb_spec.max_tokens_per_mb=28000"]), 79.6)
    assert plan.fits and not plan.sequence_fits
    (warning,) = plan.warnings
    assert "(28672 tokens, padded) does not fit a micro-batch (max_tokens_per_mb x cp = 28000)" in warning
    fixes = {tuple(f["overrides"]): f["fits"] for f in plan.fixes}
    assert fixes[("actor.mb_spec.max_tokens_per_mb=28672",)]
    assert fixes[("actor.parallel.cp=2", "actor.mb_spec.max_tokens_per_mb=14336",
                  "launch.allocation=sglang:d16+megatron:d4t2c2")]
    assert not fixes[("actor.parallel.tp=4", "launch.allocation=sglang:d16+megatron:d4t4")]  # the row stays short


def test_plan_reads_cp_from_the_actor_and_keeps_the_allocations_c_in_tp_and_pp_fixes():
    cfg = load_config("configs/boba_7b_cp.yaml", ["actor.parallel.cp=2", "actor.mb_spec.max_tokens_per_mb=16384",
                                                  "launch.allocation=sglang:d16+megatron:d4t2c2"])
    plan = make_plan(cfg, 79.6)
    assert (plan.dp, plan.cp, plan.row_tokens) == (4, 2, 32768) and not plan.trainer_fits
    fixes = {tuple(f["overrides"]): f for f in plan.fixes}
    assert ("actor.parallel.tp=4", "launch.allocation=sglang:d16+megatron:d2t4c2") in fixes
    assert fixes[("actor.parallel.cp=4", "actor.mb_spec.max_tokens_per_mb=8192",
                  "launch.allocation=sglang:d16+megatron:d2t2c4")]["fits"]


def test_cp_shards_the_optimizer_over_dp_x_cp_and_experts_over_dp_x_cp_over_ep():
    from transformers import Qwen3MoeConfig

    from areal_mcore.model.args import ModelArgs
    from areal_mcore.plan.memory import trainer_rank

    args = ModelArgs.from_hf(Qwen3MoeConfig(
        hidden_size=2048, intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
        norm_topk_prob=True, vocab_size=151936, tie_word_embeddings=False, max_position_embeddings=40960))
    dp8, dp4cp2 = (trainer_rank(args, TrainerShape(**kw, ep=4), 0).terms for kw in ({"dp": 8}, {"dp": 4, "cp": 2}))
    for term in ("weights", "grads", "main_params", "optimizer"):
        assert dp8[term] == dp4cp2[term], term  # DP x CP = 8 and expert-DP = 8 / 4 in both
    dp4 = trainer_rank(args, TrainerShape(dp=4, ep=4), 0).terms
    assert dp4["optimizer"] == pytest.approx(2 * dp8["optimizer"])


def test_cp_splits_a_ranks_activations_and_adds_tes_kv_ring_on_the_gpu():
    """TE (p2p ring): a CP rank saves what a rank of 1/cp the tokens saves, plus one layer's
    K/V chunks in flight (max(cp, 4) of them). CPU: the gathered K/V of the whole row and the
    bottom-right causal mask, quadratic in the whole sequences' lengths."""
    from areal_mcore.plan.memory import (
        cp_kv_in_flight_bytes,
        local_attention_elements,
        stage_activation_bytes,
    )

    args, _ = resolve_architecture(None, "DeepSeek-R1-Distill-Qwen-7B")
    whole = TrainerShape(tp=2, sequence_parallel=True, tokens_per_mb=16384)
    half = TrainerShape(tp=2, sequence_parallel=True, tokens_per_mb=16384, cp=2)
    kv = args.num_kv_heads * args.head_dim
    ring = cp_kv_in_flight_bytes(args, half)
    assert ring == 4 * 2 * kv / 2 * 16384 * 2 and cp_kv_in_flight_bytes(args, whole) == 0
    assert stage_activation_bytes(args, half, 0)[0] == stage_activation_bytes(args, whole, 0)[0] + ring
    local = dict(tokens_per_mb=512, path="local", dtype_bytes=4)
    one, two = (local_attention_elements(args, TrainerShape(**local, cp=cp)) for cp in (1, 2))
    q = args.num_heads * args.head_dim
    # q and linear_proj's input; the whole row's K and V; on CP rank 0 (planned) the output
    # and fp32 logsumexp of its sequences' first chunks, half its tokens (the other chunks'
    # attention is recomputed in the backward: no [queries, keys] mask is kept).
    assert two == 2 * q + 2 * kv * 2 + (q + args.num_heads) / 2
    assert one == 4 * q + 3 * kv + args.num_heads  # no quadratic term without CP
