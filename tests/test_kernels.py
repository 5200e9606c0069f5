"""Kernels: fused vocab-parallel logprob/entropy and packed GAE.

The Triton kernels run through Triton's interpreter on CPU (conftest sets
TRITON_INTERPRET=1 without a GPU), at small shapes: it is ~1000x slower than torch.
References: float64 ``log_softmax`` over the whole vocabulary with autograd, megatron's
``vocab_parallel_cross_entropy`` (the actor's previous path), and the plain-Python GAE loop.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _dist import run_gloo
from _gae_reference import random_packed, reference_gae

from areal_mcore.algo import gae_packed
from areal_mcore.kernels import triton_available, use_triton
from areal_mcore.kernels.logprob import logprob_entropy

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {"atol": 1e-5, "rtol": 1e-5}
# Small tiles so that V = 1000 spans several column blocks, the last one ragged.
SMALL_TILES = {"BLOCK_V": 128, "BLOCK_T": 16}


def _require_triton() -> None:
    """Skips without triton, or fails under ``make test`` (AREAL_REQUIRE_SYSDEPS=1), whose
    install (the ``dev`` extra) has it: there a missing triton is a broken setup."""
    if triton_available():
        return
    message = "triton does not import (the `dev` extra installs it: pip install -e '.[dev]')"
    if os.environ.get("AREAL_REQUIRE_SYSDEPS"):
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture
def small_tiles(monkeypatch):
    _require_triton()
    from areal_mcore.kernels import _logprob_triton

    for name, value in SMALL_TILES.items():
        monkeypatch.setattr(_logprob_triton, name, value)


def _inputs(T, V, vocab_size, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits_TV = (3 * torch.randn(T, V, generator=g)).to(dtype)
    targets_T = torch.randint(0, vocab_size, (T,), generator=g)
    g_logp_T, g_ent_T = torch.randn(T, generator=g), torch.randn(T, generator=g)
    return logits_TV, targets_T, g_logp_T, g_ent_T


def _reference(logits_TV, targets_T, g_logp_T, g_ent_T, *, vocab_size, temperature):
    """float64 log_softmax over the whole vocab (padding masked) and autograd."""
    x = logits_TV.detach().double().requires_grad_()
    real_V = torch.arange(x.shape[-1]) < vocab_size
    logp_TV = (x / temperature).masked_fill(~real_V, float("-inf")).log_softmax(-1)
    logp_T = logp_TV.gather(1, targets_T[:, None]).squeeze(1)
    ent_T = -(logp_TV.exp() * logp_TV.masked_fill(~real_V, 0.0)).sum(-1)
    (g_logp_T.double() @ logp_T + g_ent_T.double() @ ent_T).backward()
    return logp_T.float(), ent_T.float(), x.grad.float()


def _run(kernel, logits_TV, targets_T, g_logp_T, g_ent_T, *, vocab_size, temperature,
         use=("logp", "entropy"), **kw):
    x = logits_TV.detach().to(DEVICE, copy=True).requires_grad_()
    logp_T, ent_T = logprob_entropy(x, targets_T.to(DEVICE), vocab_size=vocab_size,
                                    temperature=temperature, kernel=kernel, **kw)
    loss = 0.0
    if "logp" in use:
        loss = loss + (g_logp_T.to(DEVICE) * logp_T).sum()
    if "entropy" in use:
        loss = loss + (g_ent_T.to(DEVICE) * ent_T).sum()
    loss.backward()
    return logp_T.detach().cpu(), ent_T.detach().cpu(), x.grad.cpu()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_torch_path_matches_float64_log_softmax_with_padding_and_chunks(temperature):
    args = _inputs(50, 1000, 990)
    got = _run("torch", *args, vocab_size=990, temperature=temperature, chunk_tokens=16)
    want = _reference(*args, vocab_size=990, temperature=temperature)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOL)
    assert torch.all(got[2][:, 990:] == 0)  # padded vocab rows get no gradient


@pytest.mark.parametrize("temperature, vocab_size, use", [
    (1.0, 1000, ("logp", "entropy")),
    (0.7, 937, ("logp", "entropy")),  # padding inside the last column block
    (0.7, 937, ("logp",)),  # entropy unused: its backward term is skipped
    (1.3, 1000, ("entropy",)),
])
def test_triton_matches_torch_path_and_reference_forward_and_backward(small_tiles, temperature,
                                                                      vocab_size, use):
    args = _inputs(37, 1000, vocab_size, seed=1)  # T, V not multiples of the tile
    got = _run("triton", *args, vocab_size=vocab_size, temperature=temperature, use=use)
    torch_path = _run("torch", *args, vocab_size=vocab_size, temperature=temperature, use=use)
    g_logp, g_ent = (g if name in use else torch.zeros_like(g)
                     for g, name in zip(args[2:], ("logp", "entropy")))
    want = _reference(*args[:2], g_logp, g_ent, vocab_size=vocab_size, temperature=temperature)
    for a, b, c in zip(got, torch_path, want):
        torch.testing.assert_close(a, b, **TOL)
        torch.testing.assert_close(a, c, **TOL)


def test_bf16_logits_accumulate_in_fp32_and_get_bf16_gradients(small_tiles):
    args = _inputs(24, 700, 650, seed=2, dtype=torch.bfloat16)
    want = _reference(*args, vocab_size=650, temperature=0.9)
    for kernel in ("torch", "triton"):
        logp_T, ent_T, grad_TV = _run(kernel, *args, vocab_size=650, temperature=0.9)
        torch.testing.assert_close(logp_T, want[0], **TOL)
        torch.testing.assert_close(ent_T, want[1], **TOL)
        assert grad_TV.dtype == torch.bfloat16
        torch.testing.assert_close(grad_TV.float(), want[2], atol=1e-2, rtol=1e-2)


# --------------------------------------------------------------------------- TP = 2

T_TP, V_PADDED = 40, 1024  # two shards of 512 columns


def _megatron_token_logprobs(logits_TV, input_ids_T, cu_seqlens_B1, *, vocab_size, tp_rank,
                             temperature):
    """The actor's previous token_logprobs: megatron's vocab_parallel_cross_entropy."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    V = logits_TV.shape[-1]
    logits = logits_TV.float() / temperature
    pad = torch.arange(tp_rank * V, (tp_rank + 1) * V, device=logits.device) >= vocab_size
    logits = logits.masked_fill(pad, float("-inf"))
    targets = torch.roll(input_ids_T, -1)
    nll = vocab_parallel_cross_entropy(logits.unsqueeze(1), targets.unsqueeze(1)).squeeze(1)
    return torch.roll(-nll, 1).index_fill(0, cu_seqlens_B1[:-1].long(), 0.0)


def _tp_worker(rank, world_size):
    from areal_mcore.actor.config import ParallelConfig
    from areal_mcore.actor.logprobs import token_logprobs
    from areal_mcore.actor.parallel import init_parallel
    from areal_mcore.kernels import _logprob_triton

    for name, value in SMALL_TILES.items():
        setattr(_logprob_triton, name, value)
    groups = init_parallel(ParallelConfig(tp=2), seed=1)
    shard = slice(rank * V_PADDED // 2, (rank + 1) * V_PADDED // 2)
    out = {}
    # 1000: rank 1 holds 24 padding columns; 400: rank 1 holds nothing but padding.
    for vocab_size in (1000, 400):
        logits_TV, targets_T, g_logp_T, g_ent_T = _inputs(T_TP, V_PADDED, vocab_size, seed=3)
        for kernel in ("torch", "triton"):
            out[kernel, vocab_size] = _run(kernel, logits_TV[:, shard], targets_T, g_logp_T, g_ent_T,
                                           vocab_size=vocab_size, temperature=0.7,
                                           tp_rank=rank, tp_group=groups.tp)
    # token_logprobs (aligned to tokens, 0 at sequence starts) against megatron's path.
    logits_TV, ids_T, g_T, _ = (t.to(DEVICE) for t in _inputs(T_TP, V_PADDED, 1000, seed=4))
    cu_B1 = torch.tensor([0, 7, 25, T_TP], device=DEVICE)
    for kernel in ("torch", "triton", "megatron"):
        x = logits_TV[:, shard].clone().requires_grad_()
        if kernel == "megatron":
            logp_T = _megatron_token_logprobs(x, ids_T, cu_B1, vocab_size=1000, tp_rank=rank,
                                              temperature=0.7)
        else:
            logp_T = token_logprobs(x, ids_T, cu_B1, vocab_size=1000, tp_rank=rank,
                                    tp_group=groups.tp, temperature=0.7, kernel=kernel)
        (g_T @ logp_T).backward()
        out["token_logprobs", kernel] = (logp_T.detach().cpu(), x.grad.cpu())
    out["entropy_bonus"] = _entropy_bonus(logits_TV[:, shard], ids_T, cu_B1, rank, groups.tp)
    return out


def _entropy_bonus(logits_TV, ids_T, cu_B1, tp_rank, tp_group):
    """(entropy_T, d/d logits) of ``ppo.entropy_coef``'s term through the aligned path: the
    same on a vocab shard of TP=2 as on the whole vocabulary."""
    from areal_mcore.actor.logprobs import token_logprobs_entropy

    x = logits_TV.clone().requires_grad_()
    logp_T, ent_T = token_logprobs_entropy(x, ids_T, cu_B1, vocab_size=1000, tp_rank=tp_rank,
                                           tp_group=tp_group, temperature=0.7, kernel="torch")
    (-0.5 * ent_T.sum() + 0.1 * logp_T.sum()).backward()  # the entropy term dominates
    return ent_T.detach().cpu(), x.grad.cpu()


@pytest.fixture(scope="module")
def tp2():
    _require_triton()
    return run_gloo(_tp_worker, 2)


@pytest.mark.parametrize("kernel", ["torch", "triton"])
@pytest.mark.parametrize("vocab_size", [1000, 400])
@pytest.mark.multirank
def test_tp2_vocab_shards_on_gloo_match_the_full_vocab(tp2, kernel, vocab_size):
    want = _reference(*_inputs(T_TP, V_PADDED, vocab_size, seed=3), vocab_size=vocab_size,
                      temperature=0.7)
    rank0, rank1 = (r[kernel, vocab_size] for r in tp2)
    for i in (0, 1):  # every rank gets the full-vocab logprob and entropy
        torch.testing.assert_close(rank0[i], want[i], **TOL)
        torch.testing.assert_close(rank1[i], want[i], **TOL)
    torch.testing.assert_close(torch.cat([rank0[2], rank1[2]], 1), want[2], **TOL)


@pytest.mark.parametrize("kernel", ["torch", "triton"])
@pytest.mark.multirank
def test_token_logprobs_equals_megatron_vocab_parallel_cross_entropy_tp2(tp2, kernel):
    for rank in tp2:
        logp_T, grad_TV = rank["token_logprobs", kernel]
        want_logp_T, want_grad_TV = rank["token_logprobs", "megatron"]
        assert logp_T[[0, 7, 25]].tolist() == [0.0, 0.0, 0.0]
        torch.testing.assert_close(logp_T, want_logp_T, **TOL)
        torch.testing.assert_close(grad_TV, want_grad_TV, **TOL)


@pytest.mark.multirank
def test_entropy_bonus_gradient_on_tp2_shards_equals_tp1(tp2):
    logits_TV, ids_T, _, _ = (t.to(DEVICE) for t in _inputs(T_TP, V_PADDED, 1000, seed=4))
    cu_B1 = torch.tensor([0, 7, 25, T_TP], device=DEVICE)
    ent_T, grad_TV = _entropy_bonus(logits_TV, ids_T, cu_B1, 0, None)
    for rank in tp2:
        torch.testing.assert_close(rank["entropy_bonus"][0], ent_T, **TOL)
    torch.testing.assert_close(torch.cat([r["entropy_bonus"][1] for r in tp2], 1), grad_TV, **TOL)


# --------------------------------------------------------------------------- GAE


@pytest.mark.parametrize("gamma, lam, with_values, masked", [
    (1.0, 1.0, False, True),  # boba
    (0.99, 0.95, True, True),
    (0.5, 1.0, True, False),
    (0.0, 0.3, False, False),
])
def test_gae_triton_matches_python_reference_on_random_packed_batches(gamma, lam, with_values,
                                                                      masked):
    _require_triton()
    for seed in range(5):
        rewards, lengths, cu, values, mask = random_packed(seed, with_values, masked)
        adv, ret = gae_packed(rewards.to(DEVICE), cu, gamma=gamma, lam=lam, values_T=values,
                              loss_mask_T=mask if masked else None, kernel="triton")
        ref_adv, ref_ret = reference_gae(rewards.tolist(), lengths,
                                         None if values is None else values.tolist(),
                                         mask.tolist(), gamma, lam)
        torch.testing.assert_close(adv.cpu(), ref_adv, **TOL)
        torch.testing.assert_close(ret.cpu(), ref_ret, **TOL)


def test_gae_triton_gives_nothing_to_a_sequence_without_actions():
    _require_triton()
    mask = torch.tensor([0, 0, 1, 1], dtype=torch.bool)
    adv, ret = gae_packed(torch.tensor([3.0, 2.0], device=DEVICE), torch.tensor([0, 2, 4]),
                          gamma=0.9, lam=0.9, loss_mask_T=mask, kernel="triton")
    assert adv.tolist() == pytest.approx([0, 0, 2 * 0.81, 2.0])
    assert torch.equal(adv, ret)


# --------------------------------------------------------------------------- compiler


def test_every_triton_kernel_compiles_to_a_hopper_cubin_without_a_gpu(tmp_path):
    """The interpreter is laxer than the compiler: compile for sm_90 too (no GPU needed)."""
    _require_triton()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # a real compile, not a cache hit
    script = Path(__file__).with_name("_triton_compile.py")
    run = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count(" ok") == 8


# --------------------------------------------------------------------------- config


def test_kernel_choice_outside_auto_triton_torch_is_rejected_naming_the_key():
    from areal_mcore.actor.config import ActorConfig, MicroBatchSpec, OptimizerConfig
    from areal_mcore.algo.config import PPOConfig

    with pytest.raises(ValueError, match="logprob_kernel='cuda'"):
        ActorConfig(mb_spec=MicroBatchSpec(max_tokens_per_mb=8), optimizer=OptimizerConfig(lr=1.0),
                    logprob_kernel="cuda")
    with pytest.raises(ValueError, match="gae_kernel='fast'"):
        PPOConfig(gae_kernel="fast")
    # "auto" means Triton exactly when there is a GPU to compile for.
    assert use_triton("auto", "k") == (torch.cuda.is_available() and triton_available())
    assert not use_triton("torch", "k")
