"""Megatron sequence parallelism on gloo: same numbers as TP without it, less activation memory."""

import pytest
import torch
from _actor_setup import ppo_loss, seqs, tiny_actor, train_fields
from _dist import run_gloo

from areal_mcore.actor.activation_memory import SavedActivationMeter
from areal_mcore.packing import pack

pytestmark = pytest.mark.multirank


def _step(rank, world, tp, pp, sp):
    actor = tiny_actor(tp=tp, pp=pp, cap=24, sp=sp)
    assert actor.config.sequence_parallel == (sp == "true")
    s = seqs()
    logp = actor.compute_logprobs(pack(s))
    with SavedActivationMeter(actor.model.parameters()) as meter:
        out = actor.train_batch(pack(s, train_fields(s)), ppo_loss, n_minibatches=2)
    hf = actor.hf_state_dict()
    return {"loss": out["loss"], "grad_norm": out["grad_norm"], "n_mb": out["n_micro_batches"],
            "logp": logp, "hf": hf if actor.groups.tp_rank == 0 else {}, "peak": meter.peak_bytes}


def _sp_and_not(rank, world, tp, pp):
    # Both layouts on the same ranks in one launch (each launch costs ~10 s here).
    return _step(rank, world, tp, pp, "true"), _step(rank, world, tp, pp, "false")


def _assert_equal(results):
    for on, off in results:
        assert all(n > 1 for n in on["n_mb"] + off["n_mb"])  # several micro-batches
        assert on["loss"] == pytest.approx(off["loss"], rel=1e-5)
        assert on["grad_norm"] == pytest.approx(off["grad_norm"], rel=1e-5)
        assert (on["logp"] - off["logp"]).abs().max() <= 1e-5
        for name, ref in off["hf"].items():
            rel = (on["hf"][name] - ref).abs().max() / ref.abs().max()
            assert rel <= 1e-5, f"{name}: relative difference {rel:.2e}"
        assert set(on["hf"]) == set(off["hf"])


def test_tp2_sequence_parallel_equals_tp2_and_saves_activation_memory():
    results = run_gloo(_sp_and_not, 2, 2, 1)
    _assert_equal(results)
    for on, off in results:
        assert on["peak"] < off["peak"], (on["peak"], off["peak"])


@pytest.mark.slow
def test_tp2_pp2_sequence_parallel_equals_tp2_pp2():
    results = run_gloo(_sp_and_not, 4, 2, 2)
    _assert_equal(results)
    # Every stage holds less: its transformer layers' norm/residual activations are sharded.
    for on, off in results:
        assert on["peak"] < off["peak"], (on["peak"], off["peak"])


def test_sequence_parallel_config_auto_is_on_with_tp_only():
    from areal_mcore.actor.config import ParallelConfig
    from areal_mcore.config import ConfigError, load_config

    assert ParallelConfig(tp=2).use_sequence_parallel
    assert not ParallelConfig(tp=1).use_sequence_parallel
    assert not ParallelConfig(tp=2, sequence_parallel="false").use_sequence_parallel
    cfg = load_config("configs/tiny_cpu.yaml", ["actor.parallel.sequence_parallel=false",
                                                "actor.parallel.tp=2"])
    assert cfg.actor.parallel.sequence_parallel == "false"
    with pytest.raises(ConfigError, match="actor.parallel.sequence_parallel"):
        load_config("configs/tiny_cpu.yaml", ["actor.parallel.sequence_parallel=maybe"])
    torch.manual_seed(0)
