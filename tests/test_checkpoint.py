"""Exact resume, DP-size change, crash safety and compatibility checks of checkpoints."""

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from _actor_setup import ppo_loss as _ppo_loss
from _actor_setup import seqs as _seqs
from _actor_setup import tiny_actor as _actor
from _actor_setup import train_fields as _train_fields
from _dist import run_gloo

from areal_mcore.packing import pack

N_STEPS, SAVE_AT = 3, 1


def _batch(step, dp_rank, dp_size):
    """Step ``step``'s data (a stand-in for the data loader), this DP rank's share."""
    seqs = _seqs(seed=100 + step)
    fields = _train_fields(seqs, seed=200 + step)
    mine = [i for mb in (range(4), range(4, 8)) for i in list(mb)[dp_rank::dp_size]]
    return pack([seqs[i] for i in mine], {k: [v[i] for i in mine] for k, v in fields.items()})


def _checkpointer(root):
    from areal_mcore.actor.checkpoint import CheckpointConfig, Checkpointer

    return Checkpointer(CheckpointConfig(root=root, keep_last=2), dist.group.WORLD)


def _train_worker(rank, world, root, resume, save_at, tp=1, arch="qwen2", ep=1, cp=1):
    actor = _actor(cap=16, tp=tp, arch=arch, ep=ep, cp=cp)
    ckpt = _checkpointer(root)
    start = ckpt.load(actor).extra["data_position"] if resume else 0
    g, losses = actor.groups, []
    for step in range(start, N_STEPS):
        losses += actor.train_batch(_batch(step, g.dp_rank, g.dp_size), _ppo_loss, 2)["loss"]
        if save_at == step + 1:
            ckpt.save(actor, step=step + 1, weight_version=step + 1,
                      extra={"data_position": step + 1}, config_snapshot={"note": "test"})
            break  # the process ends here, as if killed after the save
    return losses, actor.hf_state_dict()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return run_gloo(_train_worker, 1, str(tmp_path_factory.mktemp("full")), False, None)[0]


@pytest.mark.slow
def test_resume_is_bitwise_identical_to_an_uninterrupted_run(uninterrupted, tmp_path):
    first, _ = run_gloo(_train_worker, 1, str(tmp_path), False, SAVE_AT)[0]
    rest, weights = run_gloo(_train_worker, 1, str(tmp_path), True, None)[0]
    losses, ref_weights = uninterrupted
    assert first + rest == losses  # bitwise: exact float equality
    assert set(weights) == set(ref_weights)
    assert all(torch.equal(weights[k], ref_weights[k]) for k in ref_weights)
    assert (tmp_path / "latest").read_text() == f"step_{SAVE_AT:08d}"


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("tp, ep", [(2, 1), (1, 2)])
def test_resume_of_a_qwen3_moe_actor_is_bitwise_identical(tmp_path, tp, ep):
    """TP=2: experts split over TP, routers replicated, the optimizer's expert state. EP=2
    (DP=2): each rank saves its 4 experts and their optimizer state (megatron's
    expert-parallel sharded keys and expert-DP optimizer buffers). All resume."""
    moe = (tp, "qwen3_moe", ep)
    losses, ref_weights = run_gloo(_train_worker, 2, str(tmp_path / "full"), False, None, *moe)[0]
    first, _ = run_gloo(_train_worker, 2, str(tmp_path / "cut"), False, SAVE_AT, *moe)[0]
    rest, weights = run_gloo(_train_worker, 2, str(tmp_path / "cut"), True, None, *moe)[0]
    assert first + rest == losses
    assert set(weights) == set(ref_weights) and "model.layers.3.mlp.experts.7.up_proj.weight" in weights
    assert all(torch.equal(weights[k], ref_weights[k]) for k in ref_weights)


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("cp", [1, 2])
def test_resume_with_another_dp_or_cp_size_is_close(uninterrupted, tmp_path, cp):
    """Saved at DP 2 (or CP 2: the optimizer is sharded over DP x CP), resumed on one rank.
    CP ranks are replicas of the weights: the checkpoint is the same model."""
    results = run_gloo(_train_worker, 2, str(tmp_path), False, SAVE_AT, 1, "qwen2", 1, cp)
    assert results[0][0] == results[1][0]
    rest, weights = run_gloo(_train_worker, 1, str(tmp_path), True, None)[0]
    losses, ref_weights = uninterrupted
    assert results[0][0] + rest == pytest.approx(losses, rel=1e-5)
    for name, ref in ref_weights.items():
        assert (weights[name] - ref).abs().max() / ref.abs().max() <= 1e-5, name


def _crash_worker(rank, world, root):
    import areal_mcore.actor.checkpoint as ck

    actor = _actor(cap=16)
    ckpt = _checkpointer(root)
    for step in (1, 2, 3):  # keep_last=2 prunes step 1
        ckpt.save(actor, step=step, weight_version=step)
    saved = actor.hf_state_dict()
    actor.train_batch(_batch(0, 0, 1), _ppo_loss, 2)

    def failing_save(obj, path):
        raise OSError(28, "No space left on device (simulated)")

    def failing_write_item(*args, **kwargs):
        raise OSError(28, "No space left on device (simulated)")

    def save_raising():
        try:
            ckpt.save(actor, step=4, weight_version=4)
        except (OSError, RuntimeError) as e:
            return getattr(e, "errno", None), str(e)

    ck._save_file, real = failing_save, ck._save_file
    raised = save_raising()
    ck._save_file = real
    # The same disk full inside megatron's own writer (a forked process in 0.16.1, a thread
    # in 0.19.2, both calling this module global): it raises torch's CheckpointException,
    # a BaseException, which used to escape the save without naming the folder.
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async._write_item, real = failing_write_item, filesystem_async._write_item
    raised_by_megatron = save_raising()
    filesystem_async._write_item = real
    latest_after_crash = (Path(root) / "latest").read_text()
    resumed = _actor(cap=16)
    state = ckpt.load(resumed)
    after = resumed.hf_state_dict()
    same = all(torch.equal(after[k], saved[k]) for k in saved)
    crashed_entries = sorted(p.name for p in Path(root).iterdir())
    ckpt.save(actor, step=4, weight_version=4)  # the next save clears the crashed one
    return (raised, raised_by_megatron, latest_after_crash, state.step, crashed_entries, same,
            sorted(p.name for p in Path(root).iterdir()))


def test_a_write_error_without_errno_on_a_full_disk_is_named_enospc(tmp_path, monkeypatch):
    """megatron's common-state save is ``torch.save`` to a path: on a full disk its C++
    stream fails as "basic_ios::clear: iostream error", with no errno to name the cause."""
    import shutil

    from areal_mcore.actor import checkpoint as ck

    iostream = RuntimeError("basic_ios::clear: iostream error")
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(ck.shutil, "disk_usage", lambda p: usage._replace(free=ck.FULL_BELOW - 1))
    assert ck._errno(iostream, tmp_path / ".step_1.tmp") == 28
    assert ck._errno(None, tmp_path / ".step_1.tmp") is None  # this rank wrote its share
    monkeypatch.setattr(ck.shutil, "disk_usage", lambda p: usage._replace(free=ck.FULL_BELOW))
    assert ck._errno(iostream, tmp_path / ".step_1.tmp") is None  # space left: another failure


@pytest.mark.slow
def test_crash_during_save_keeps_previous_checkpoint_and_latest(tmp_path):
    raised, by_megatron, latest, step, entries, same, after = run_gloo(_crash_worker, 1, str(tmp_path))[0]
    errno, message = raised  # an OS error stays one, naming the folder and what is current
    assert errno == 28 and ".step_00000004.tmp" in message and "still names the previous" in message
    errno, message = by_megatron  # megatron 0.19.2's writer threads report only "<class 'OSError'>"
    assert errno == (28 if "[Errno 28]" in message else None), message
    assert ".step_00000004.tmp" in message and "still names the previous" in message
    assert latest == "step_00000003" and step == 3 and same
    assert "step_00000001" not in entries and {"step_00000002", "step_00000003"} <= set(entries)
    assert ".step_00000004.tmp" not in entries  # the half-written save is removed
    assert after == ["latest", "step_00000003", "step_00000004"]


def _group_sigterm_worker(rank, world, root):
    """Saves, then gets SIGTERM as scancel, ``scontrol requeue`` and torchrun send it: to
    every process of its group (this rank leads its own, so pytest is spared), handled as
    the trainer does (a flag), then saves again, the stop checkpoint, while two more group
    SIGTERMs arrive (a second scancel; Slurm's signal to the step after the batch
    shell's)."""
    import os
    import signal
    import threading
    import time

    import psutil

    os.setpgid(0, 0)
    got = []
    signal.signal(signal.SIGTERM, lambda *_: got.append(True))
    actor = _actor(cap=16)
    ckpt = _checkpointer(root)
    ckpt.save(actor, step=1, weight_version=1)
    helpers = [c.cmdline() for c in psutil.Process().children(recursive=True)]
    os.killpg(0, signal.SIGTERM)
    time.sleep(0.5)  # what the signal kills is dead by now

    def twice():
        for _ in range(2):
            time.sleep(0.02)
            os.killpg(0, signal.SIGTERM)

    mid_save = threading.Thread(target=twice)
    mid_save.start()
    try:
        ckpt.save(actor, step=2, weight_version=2)
        mid_save.join()
        error = None
    except (OSError, RuntimeError) as e:
        error = f"{type(e).__name__}: {e}"
    return got, helpers, error, (Path(root) / "latest").read_text()


def test_a_sigterm_to_the_whole_process_group_leaves_the_stop_checkpoint_working(tmp_path):
    """megatron's save kept its results queue in a multiprocessing Manager (a spawned
    process, started by the first save) that ignores SIGINT but not SIGTERM: after a
    group SIGTERM the next save, the stop checkpoint, failed with BrokenPipeError
    [Errno 32] and ``latest`` stayed at the save before. Now the queue is in-process."""
    got, helpers, error, latest = run_gloo(_group_sigterm_worker, 1, str(tmp_path))[0]
    assert got == [True] * 3 and error is None, (error, helpers)
    assert latest == "step_00000002" and not any("spawn_main" in " ".join(h) for h in helpers), helpers


def _weights_only_worker(rank, world, root):
    """A weights-only checkpoint (``convert hf-to-mcore``'s) of trained weights, whose
    optimizer ran at another learning rate, loaded into a fresh actor: it trains as an
    actor built from those weights does, at its own learning rate."""
    trained = _actor(cap=16)
    trained.train_batch(_batch(0, 0, 1), _ppo_loss, 2)
    for group in trained.optimizer.param_groups:
        group["lr"] = 1e-5  # the converter's optimizer
    _checkpointer(root).save(trained, step=0, weight_version=0, weights_only=True)
    weights = trained.hf_state_dict()
    loaded, built = _actor(cap=16), _actor(cap=16)
    state = _checkpointer(root).load(loaded)
    built.load_hf_state_dict(weights)
    lrs = [g["lr"] for g in loaded.optimizer.param_groups]
    same = all(torch.equal(loaded.hf_state_dict()[k], v) for k, v in weights.items())
    losses = [a.train_batch(_batch(1, 0, 1), _ppo_loss, 2)["loss"] for a in (loaded, built)]
    return state.weights_only, state.extra, lrs, same, losses


def test_a_weights_only_checkpoint_loads_the_weights_and_keeps_the_runs_optimizer(tmp_path):
    weights_only, extra, lrs, same, (loaded, built) = run_gloo(_weights_only_worker, 1, str(tmp_path))[0]
    assert weights_only and extra == {} and same
    assert set(lrs) == {1e-3}  # not the converter's 1e-5
    assert loaded == built


def _draws():
    """One draw from each generator a checkpoint restores (python, numpy, torch)."""
    import random

    import numpy as np

    return random.random(), float(np.random.rand()), torch.rand(1).item()


def _corrupt_worker(rank, world, root):
    actor, ckpt, weights, draws = _actor(cap=16), _checkpointer(root), {}, {}
    for step in (1, 2, 3):  # keep_last=2 keeps steps 2 and 3
        actor.train_batch(_batch(step - 1, 0, 1), _ppo_loss, 2)
        ckpt.save(actor, step=step, weight_version=step)
        draws[step] = _draws()  # what the generators give next from the saved state
        weights[step] = {k: v.clone() for k, v in actor.hf_state_dict().items()}
    distcp = sorted((Path(root) / "step_00000003" / "model").glob("*.distcp"))[0]
    data = bytearray(distcp.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte inside the tensor data: torch.load loads it
    distcp.write_bytes(bytes(data))
    resumed = _actor(cap=16)
    state = ckpt.load(resumed)
    after = resumed.hf_state_dict()
    return (state.step, all(torch.equal(after[k], weights[2][k]) for k in weights[2]), str(distcp),
            _draws(), draws[2], draws[3])


def test_a_flipped_byte_in_a_checkpoint_is_named_and_the_previous_one_is_resumed(tmp_path, capsys):
    import areal_mcore.cli as cli

    step, same, damaged, resumed_draws, step2_draws, step3_draws = run_gloo(_corrupt_worker, 1, str(tmp_path))[0]
    assert step == 2 and same  # not step 3, silently, with damaged weights
    # The generators go on from step 2's saved state, not from where the process was.
    assert resumed_draws == step2_draws != step3_draws
    capsys.readouterr()
    assert cli.main(["verify-checkpoint", str(tmp_path / "step_00000003"), str(tmp_path / "step_00000002")]) == 1
    out = capsys.readouterr().out
    assert f"{damaged}: content differs from the saved SHA-256" in out, out
    assert f"{tmp_path / 'step_00000002'}: OK" in out, out


# --------------------------------------------------------------------------- no processes


def _fake_actor(tp=1, pp=1, **args_overrides):
    from areal_mcore.model.args import ModelArgs

    args = ModelArgs(model_type="qwen2", vocab_size=250, hidden_size=64, num_layers=4, num_heads=4,
                     num_kv_heads=2, head_dim=16, ffn_hidden_size=96, rms_norm_eps=1e-6,
                     rope_theta=1e4, qkv_bias=True, tie_word_embeddings=False,
                     max_position_embeddings=256)
    return SimpleNamespace(args=dataclasses.replace(args, **args_overrides),
                           groups=SimpleNamespace(tp_size=tp, pp_size=pp, ep_size=1))


def _manifest(actor, tp=1, pp=1):
    from areal_mcore.actor.checkpoint import FORMAT

    return {"format": FORMAT, "layout": {"tp": tp, "pp": pp, "dp": 1, "world": tp * pp},
            "model_args": dataclasses.asdict(actor.args)}


def test_other_tp_pp_layout_is_rejected_with_the_fix():
    from areal_mcore.actor.checkpoint import _check_compatible

    with pytest.raises(ValueError, match=r"tp=2, pp=1; this run has tp=1, pp=2.*tools/convert_ckpt"):
        _check_compatible(_manifest(_fake_actor(), tp=2, pp=1), _fake_actor(pp=2), Path("ck"))


def test_another_expert_parallel_size_is_rejected_naming_the_key():
    from areal_mcore.actor.checkpoint import _check_compatible

    manifest = _manifest(_fake_actor())
    manifest["layout"]["ep"] = 2
    with pytest.raises(ValueError, match=r"saved with ep=2; this run has actor.parallel.ep=1"):
        _check_compatible(manifest, _fake_actor(), Path("ck"))
    del manifest["layout"]["ep"]  # a checkpoint from before expert parallelism
    _check_compatible(manifest, _fake_actor(), Path("ck"))


def test_another_vocabulary_padding_is_refused_naming_the_key_and_the_converter_flag():
    """megatron's load failed with "Global shape mismatch" on the optimizer's embedding
    state (a `convert hf-to-mcore` at its default padding of 128, a run at 8)."""
    from areal_mcore.actor.checkpoint import _check_compatible

    manifest, actor = _manifest(_fake_actor()), _fake_actor()
    actor.padded_vocab, actor.cfg = 256, SimpleNamespace(vocab_divisible_by=8)
    manifest["padded_vocab"] = 256
    _check_compatible(manifest, actor, Path("ck"))
    manifest["padded_vocab"] = 384
    with pytest.raises(ValueError, match=r"pads the vocabulary \(250\) to 384 rows; this run pads it to 256 "
                                         r"\(actor.vocab_divisible_by=8 x tp=1\).*--vocab-divisible-by 8"):
        _check_compatible(manifest, actor, Path("ck"))


def test_model_mismatch_lists_every_differing_field():
    from areal_mcore.actor.checkpoint import _check_compatible

    saved = _manifest(_fake_actor())
    with pytest.raises(ValueError) as e:
        _check_compatible(saved, _fake_actor(hidden_size=128, rope_theta=1e6), Path("ck"))
    assert "hidden_size: checkpoint 64 vs model 128" in str(e.value)
    assert "rope_theta: checkpoint 10000.0 vs model 1000000.0" in str(e.value)


def test_a_checkpoint_of_a_newer_megatron_core_is_refused_naming_both_versions():
    from areal_mcore.actor.checkpoint import _check_compatible
    from areal_mcore.model.mcore_compat import MCORE_VERSION, MCORE_VERSION_STR

    actor = _fake_actor()
    newer = f"{MCORE_VERSION[0]}.{MCORE_VERSION[1] + 1}.0+abc1234"
    saved = {**_manifest(actor), "versions": {"megatron_core": newer}}
    with pytest.raises(ValueError) as e:
        _check_compatible(saved, actor, Path("ck"))
    assert f"saved by megatron-core {newer}" in str(e.value)
    assert f"this run has megatron-core {MCORE_VERSION_STR}" in str(e.value)
    assert "mcore-to-hf" in str(e.value)
    for loadable in (MCORE_VERSION_STR, "0.16.1", f"{MCORE_VERSION[0]}.{MCORE_VERSION[1]}.99"):
        _check_compatible({**_manifest(actor), "versions": {"megatron_core": loadable}}, actor, Path("ck"))


def test_megatron_core_versions_parse_with_local_and_pre_release_parts():
    from areal_mcore.model.mcore_compat import parse_version

    assert parse_version("0.19.2+f8f4eb2") == (0, 19, 2)
    assert parse_version("0.20.0rc1") == (0, 20, 0)
    assert parse_version("1.2") == (1, 2, 0)
    with pytest.raises(ValueError, match="not a megatron-core version"):
        parse_version("dev")
