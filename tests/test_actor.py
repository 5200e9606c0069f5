"""The megatron-core actor on CPU: HF parity, THD packing, TP/PP/DP training parity."""

from functools import partial

import pytest
import torch
import torch.distributed as dist
from _actor_setup import VOCAB
from _actor_setup import ppo_loss as _ppo_loss
from _actor_setup import seqs as _seqs
from _actor_setup import tiny_actor as _actor
from _actor_setup import train_fields as _train_fields
from _dist import run_gloo
from _tiny_model import tiny_qwen2

from areal_mcore.algo import reduce_ppo_stats
from areal_mcore.packing import pack


def _hf_reference(seqs, tie=False):
    _, _, hf = tiny_qwen2(tie=tie, vocab=VOCAB)
    logits, logps = [], []
    with torch.no_grad():
        for s in seqs:
            lg = hf(s[None]).logits[0]
            logits.append(lg)
            lp = torch.zeros(len(s))
            lp[1:] = lg[:-1].log_softmax(-1).gather(1, s[1:, None]).squeeze(1)
            logps.append(lp)
    return torch.cat(logits), torch.cat(logps)


# --------------------------------------------------------------------------- workers


def _logits_worker(rank, world, tp, tie):
    from megatron.core.packed_seq_params import PackedSeqParams

    # The model is called directly on odd lengths here; SP needs them padded to TP.
    actor = _actor(tp=tp, tie=tie, sp="false")
    batch = pack(_seqs())
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=batch.cu_seqlens,
                             cu_seqlens_kv=batch.cu_seqlens, max_seqlen_q=batch.max_seqlen,
                             max_seqlen_kv=batch.max_seqlen)
    with torch.no_grad():
        packed = actor.model.module(batch.input_ids[None], batch.position_ids[None],
                                    attention_mask=None, packed_seq_params=params)[0]
        separate = torch.cat([actor.model.module(s[None], torch.arange(len(s))[None],
                                                 attention_mask=None)[0] for s in _seqs()])
    gathered = [torch.empty_like(packed) for _ in range(tp)]
    dist.all_gather(gathered, packed.contiguous(), group=actor.groups.tp)
    return torch.cat(gathered, -1)[:, :VOCAB], packed, separate, actor.compute_logprobs(batch)


def _train_worker(rank, world, tp, pp, recompute=False, hf_dir=None):
    actor = _actor(tp=tp, pp=pp, cap=16, recompute=recompute)
    seqs = _seqs()
    g = actor.groups
    # DP rank r holds half of each minibatch, so the union of a minibatch over the DP
    # ranks is the single-process minibatch.
    n = len(seqs) // 2
    mine = [i for mb in (range(n), range(n, 2 * n)) for i in list(mb)[g.dp_rank::g.dp_size]]
    sub = [seqs[i] for i in mine]
    fields = {k: [v[i] for i in mine] for k, v in _train_fields(seqs).items()}
    logp = actor.compute_logprobs(pack(sub))  # before the update; on every rank
    out = actor.train_batch(pack(sub, fields), _ppo_loss, n_minibatches=2,
                            reduce_stats=reduce_ppo_stats)
    if g.is_last_stage:
        assert 0.0 <= out["stats"]["clip_ratio"] <= 1.0 and out["stats"]["loss_tokens"] > 0
    hf = actor.hf_state_dict()  # collective over TP: every rank calls it
    if hf_dir is not None:
        from areal_mcore.convert.save_hf import save_hf

        save_hf(actor, hf_dir, max_shard_bytes=100_000)
    return out["loss"], out["n_micro_batches"], hf if g.tp_rank == 0 and g.dp_rank == 0 else {}, logp


# --------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def forward_tp1():
    return run_gloo(_logits_worker, 1, 1, False)[0]


@pytest.fixture(scope="module")
def forward_tp2():
    return run_gloo(_logits_worker, 2, 2, False)[0]


@pytest.mark.parametrize("results", ["forward_tp1", pytest.param("forward_tp2", marks=pytest.mark.multirank)])
def test_megatron_logits_equal_transformers_logits(results, request):
    logits, _, _, _ = request.getfixturevalue(results)
    ref_logits, _ = _hf_reference(_seqs())
    assert (logits - ref_logits).abs().max() <= 1e-4


def test_packed_thd_forward_equals_separate_forwards(forward_tp1):
    _, packed, separate, _ = forward_tp1
    assert (packed - separate).abs().max() <= 1e-5


@pytest.mark.parametrize("results", ["forward_tp1", pytest.param("forward_tp2", marks=pytest.mark.multirank)])
def test_compute_logprobs_equals_transformers_log_softmax(results, request):
    *_, logp = request.getfixturevalue(results)
    _, ref = _hf_reference(_seqs())
    assert (logp - ref).abs().max() <= 1e-5


def test_compute_logprobs_with_tied_embeddings():
    *_, logp = run_gloo(_logits_worker, 1, 1, True)[0]
    _, ref = _hf_reference(_seqs(), tie=True)
    assert (logp - ref).abs().max() <= 1e-5


@pytest.fixture(scope="module")
def reference_step():
    return run_gloo(_train_worker, 1, 1, 1)[0]


def _merge_stages(results):
    merged = {}
    for _, _, hf, _ in results:
        merged.update(hf)
    return merged


def _assert_same_step(results, reference):
    loss, n_mbs, ref_hf, _ = reference
    assert all(n > 1 for n in n_mbs), "the reference must run several micro-batches"
    for rank_loss, rank_mbs, _, _ in results:
        assert rank_loss == pytest.approx(loss, rel=1e-5)
        assert all(n > 1 for n in rank_mbs)
    hf = _merge_stages(results)
    assert set(hf) == set(ref_hf)
    for name, ref in ref_hf.items():
        rel = (hf[name] - ref).abs().max() / ref.abs().max()
        assert rel <= 1e-5, f"{name}: relative difference {rel:.2e}"


@pytest.mark.slow
@pytest.mark.multirank
def test_train_step_tp2_pp2_equals_single_process(reference_step, tmp_path):
    from areal_mcore.convert.tools import load_hf_state_dict

    results = run_gloo(_train_worker, 4, 2, 2, False, str(tmp_path))
    _assert_same_step(results, reference_step)
    # compute_logprobs through the PP schedule, broadcast from the last stage to all ranks.
    for *_, logp in results:
        assert (logp - reference_step[3]).abs().max() <= 1e-5
    # save_hf from the 4 ranks wrote exactly the trained weights, in several shards.
    saved, trained = load_hf_state_dict(tmp_path), _merge_stages(results)
    assert set(saved) == set(trained) and all(torch.equal(saved[k], trained[k]) for k in trained)
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    assert (tmp_path / "config.json").exists()


@pytest.mark.slow
@pytest.mark.multirank
def test_train_step_dp2_equals_single_process(reference_step):
    _assert_same_step(run_gloo(_train_worker, 2, 1, 1), reference_step)


@pytest.mark.slow
def test_train_step_with_activation_recompute_equals_without(reference_step):
    _assert_same_step(run_gloo(_train_worker, 1, 1, 1, True), reference_step)


@pytest.mark.parametrize("pad,cp", [(1, 1), (4, 1), (4, 2)])
def test_the_loss_gets_the_micro_batch_on_the_actors_device(pad, cp):
    """On a GPU the logprobs are on the device: the loss's mask and advantages must be too
    (sft_loss multiplied GPU logprobs by a CPU mask). The emulated device refuses the mix.
    Without padding the four cu_seqlens fields are one tensor (TE 2.4-2.10 compares the
    padded ones with the true ones on the device, a sync per layer, unless they are).
    Under CP the model gets this rank's tokens, and the loss this rank's share of the
    micro-batch (its index tensors built on the host and moved)."""
    from types import SimpleNamespace

    from _fake_cuda import FakeCuda, is_fake_cuda

    from areal_mcore.actor.megatron_actor import MegatronActor
    from areal_mcore.trainer.sft import sft_loss

    seqs = [torch.tensor([1, 2, 3]), torch.tensor([4, 5])]
    mb = pack(seqs, {"loss_mask": [torch.tensor([0.0, 1, 1]), torch.tensor([0.0, 1])]}, pad_to_multiple_of=pad)
    seen = {}

    def model(ids, pos, attention_mask, packed_seq_params):
        seen.update(ids=ids, params=packed_seq_params)
        return torch.randn(1, ids.shape[1], 8, device="cuda")  # logits on the GPU

    def loss_func(mb, logits):
        logp, _ = MegatronActor._logprobs(actor, mb, logits, temperature=1.0)
        mb = MegatronActor._loss_view(actor, mb)
        assert all(is_fake_cuda(t) for t in (logp, mb.input_ids, mb.cu_seqlens_padded, *mb.fields.values()))
        return sft_loss(logp, mb, torch.tensor(3.0))

    with FakeCuda():
        actor = SimpleNamespace(device=torch.device("cuda", 0), args=SimpleNamespace(vocab_size=8),
                                cfg=SimpleNamespace(logprob_kernel="torch"), _router_counts=None,
                                groups=SimpleNamespace(cp_size=cp, cp_rank=0, cp=None, tp_rank=0, tp=None))
        actor._cp_index = partial(MegatronActor._cp_index, actor)
        logits, on_logits = MegatronActor._forward_step(actor, loss_func, iter([mb]), model)
        loss, _ = on_logits(logits)
    assert is_fake_cuda(loss) and is_fake_cuda(seen["ids"])
    assert seen["ids"].shape[1] == mb.input_ids.numel() // cp
    p = seen["params"]
    assert all(is_fake_cuda(t) for t in (p.cu_seqlens_q, p.cu_seqlens_q_padded))
    assert (p.cu_seqlens_q_padded is p.cu_seqlens_q) == (pad == 1)
    assert p.cu_seqlens_kv_padded is p.cu_seqlens_q_padded and p.cu_seqlens_kv is p.cu_seqlens_q


@pytest.mark.parametrize("tp,built_on", [(1, "cuda"), (2, "cuda"), (2, "cpu")])
def test_the_micro_batch_loop_never_waits_for_the_device(tp, built_on):
    """Issue 42, finding 4. On a GPU the PPO batch is built on the device (trainer/batch.py)
    and the SFT batch on the host; planning a minibatch (TP alignment, micro-batch bins,
    selection) and each micro-batch's forward step and loss must not block the host on the
    device (tests/_fake_cuda.py logs what would). The only syncs left are TE's: with
    sequence parallelism (TP=2) the sequences are padded to TP and TE 2.4-2.10 compares the
    padded cu_seqlens with the true ones in every attention layer (DotProductAttention.forward,
    pad_between_seqs); unpadded, the actor passes one tensor and the compare is free."""
    from types import SimpleNamespace

    from _fake_cuda import FakeCuda

    from areal_mcore.actor.megatron_actor import MegatronActor
    from areal_mcore.packing import allocate_micro_batches

    layers, vocab, cap = 3, 16, 24
    seqs = _seqs([7, 12, 5, 9, 11, 3])  # odd lengths: padded under sequence parallelism at TP=2
    fields = {k: [v.float() for v in vs] for k, vs in _train_fields(seqs).items()}
    actor = SimpleNamespace(device=torch.device("cuda", 0), args=SimpleNamespace(vocab_size=vocab),
                            cfg=SimpleNamespace(logprob_kernel="torch"), _router_counts=None,
                            groups=SimpleNamespace(tp_rank=0, tp=None, tp_size=tp, cp_size=1),
                            config=SimpleNamespace(sequence_parallel=tp > 1))

    def model(ids, pos, attention_mask, packed_seq_params):
        p = packed_seq_params
        for _ in range(layers):  # TE 2.4-2.10 DotProductAttention.forward, per layer
            torch.equal(p.cu_seqlens_q_padded[:-1], p.cu_seqlens_q[:-1])
        return torch.randn(1, ids.shape[1], vocab, device="cuda")

    def loss_func(mb, logits):
        logp, _ = MegatronActor._logprobs(actor, mb, logits, temperature=1.0)
        return _ppo_loss(logp, mb, tokens, None)

    with FakeCuda() as device:
        tokens = torch.tensor(50.0).to("cuda")  # (the minibatch's count: one all-reduce per minibatch)
        on = [s.to(built_on) for s in seqs], {k: [v.to(built_on) for v in vs] for k, vs in fields.items()}
        batch = pack(*on)
        device.syncs.clear()
        sub = MegatronActor._aligned(actor, batch)
        micro = sub.select_many(allocate_micro_batches(sub.seqlens_padded, cap))
        planning = list(device.syncs)
        for mb in micro:
            logits, on_logits = MegatronActor._forward_step(actor, loss_func, iter([mb]), model)
            on_logits(logits)
    loop = device.syncs[len(planning):]
    assert len(micro) > 1
    assert loop == (["equal"] * layers * len(micro) if tp > 1 else [])  # TE's own, per layer
    assert planning == []
