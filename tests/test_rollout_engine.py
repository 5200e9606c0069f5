"""The embedded server's decoding engine against transformers as the reference."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from _rollout import EOS
from _tiny_model import tiny_qwen2

from areal_mcore.rollout.embedded.engine import DecodeEngine, Request
from areal_mcore.rollout.protocol import SamplingParams


@pytest.fixture(scope="module")
def model():
    _, _, m = tiny_qwen2(3)
    m.config._attn_implementation = "sdpa"
    return m.requires_grad_(False)


def _prompts(n, seed=0, lo=3, hi=40):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 240, (int(torch.randint(lo, hi, (1,), generator=g)),),
                          generator=g).tolist() for _ in range(n)]


def _run(engine, prompts, params, rid="r"):
    """Submits all prompts at once; returns finished requests in prompt order."""
    done, left = {}, threading.Semaphore(0)

    def on_done(r):
        done[r.rid] = r
        left.release()
    for i, p in enumerate(prompts):
        ps = params[i] if isinstance(params, list) else params
        engine.submit(Request(rid=f"{rid}{i}", input_ids=p, params=ps, on_done=on_done))
    for _ in prompts:
        assert left.acquire(timeout=120), "engine did not finish"
    return [done[f"{rid}{i}"] for i in range(len(prompts))]


@pytest.fixture
def engine(model):
    eng = DecodeEngine(model, eos_token_ids=[EOS], context_length=256, max_running_requests=64)
    yield eng
    eng.close()


def test_greedy_batched_equals_transformers_generate_token_for_token(model, engine):
    prompts = _prompts(12, seed=1)
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    got = _run(engine, prompts, params)
    for p, r in zip(prompts, got):
        ref = model.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert r.output_ids == ref
        assert r.finish_reason == {"type": "length", "length": 24}


def test_logprobs_equal_teacher_forced_log_softmax(model, engine):
    prompts = _prompts(8, seed=2)
    got = _run(engine, prompts, SamplingParams(max_new_tokens=16, temperature=1.0, sampling_seed=5))
    for p, r in zip(prompts, got):
        full = torch.tensor([p + r.output_ids])
        logp = torch.log_softmax(model(full).logits[0].float(), -1)
        ref = logp[len(p) - 1:-1].gather(-1, torch.tensor(r.output_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(r.logprobs), ref, atol=1e-5, rtol=0)


def test_requests_joining_mid_decode_get_the_same_greedy_tokens(model, engine):
    """Continuous batching must not change results: a request that joins a running batch
    (different cache lengths, left padding) decodes as it would alone."""
    prompts = _prompts(6, seed=3)
    greedy = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)
    alone = [_run(engine, [p], greedy, rid=f"a{i}-")[0].output_ids for i, p in enumerate(prompts)]
    # Staggered: long-running first request, others arrive while it decodes.
    params = [SamplingParams(max_new_tokens=60, temperature=0.0, ignore_eos=True)] + [greedy] * 5
    done, left = {}, threading.Semaphore(0)

    def on_done(r):
        done[r.rid] = r
        left.release()
    engine.submit(Request(rid="s0", input_ids=prompts[0], params=params[0], on_done=on_done))
    steps0 = engine.steps
    for i in range(1, 6):
        while engine.steps < steps0 + 3 * i:  # join at different decode steps
            time.sleep(0.001)
        engine.submit(Request(rid=f"s{i}", input_ids=prompts[i], params=params[i], on_done=on_done))
    for _ in range(6):
        assert left.acquire(timeout=120)
    assert done["s0"].output_ids[:20] == alone[0]
    for i in range(1, 6):
        assert done[f"s{i}"].output_ids == alone[i]


def test_sampling_is_reproducible_per_seed_and_respects_top_k(engine):
    p = _prompts(1, seed=4)[0]
    a = _run(engine, [p] * 3, SamplingParams(max_new_tokens=12, sampling_seed=7, top_k=3), rid="a")
    b = _run(engine, [p], SamplingParams(max_new_tokens=12, sampling_seed=7, top_k=3), rid="b")
    c = _run(engine, [p], SamplingParams(max_new_tokens=12, sampling_seed=8, top_k=3), rid="c")
    assert a[0].output_ids == a[1].output_ids == a[2].output_ids == b[0].output_ids
    assert c[0].output_ids != b[0].output_ids


def test_top_k_and_top_p_only_sample_allowed_tokens(model, engine):
    p = _prompts(1, seed=5)[0]
    for params in (SamplingParams(max_new_tokens=1, top_k=2), SamplingParams(max_new_tokens=1, top_p=0.05)):
        outs = _run(engine, [p] * 30, [SamplingParams(**{**params.to_json(), "sampling_seed": s})
                                        for s in range(30)], rid=f"k{params.top_k}")
        logits = model(torch.tensor([p])).logits[0, -1]
        probs = torch.softmax(logits, -1)
        order = torch.argsort(probs, descending=True)
        if params.top_k == 2:
            allowed = set(order[:2].tolist())
        else:  # smallest prefix whose mass reaches top_p
            cum = probs[order].cumsum(0)
            allowed = set(order[: int((cum < 0.05).sum()) + 1].tolist())
        assert {o.output_ids[0] for o in outs} <= allowed


def test_stop_tokens_and_eos(engine):
    p = _prompts(1, seed=6)[0]
    free = _run(engine, [p], SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True), rid="f")[0]
    stop_at = free.output_ids[3]
    first = free.output_ids.index(stop_at)
    r = _run(engine, [p], SamplingParams(max_new_tokens=10, temperature=0, stop_token_ids=[stop_at]),
             rid="s")[0]
    assert r.output_ids == free.output_ids[:first + 1]  # the matched stop token is returned
    assert r.finish_reason == {"type": "stop", "matched": stop_at}
    z = _run(engine, [p], SamplingParams(max_new_tokens=0), rid="z")[0]
    assert z.output_ids == [] and z.finish_reason == {"type": "length", "length": 0}


def test_abort_returns_partial_output_and_frees_the_slot(engine):
    p = _prompts(1, seed=7)[0]
    done = threading.Event()
    box = {}

    def on_done(r):
        box["r"] = r
        done.set()
    engine.submit(Request(rid="x", input_ids=p, params=SamplingParams(max_new_tokens=200,
                          ignore_eos=True), on_done=on_done))
    while engine.steps < 5:
        time.sleep(0.001)
    assert engine.abort("x") == 1
    assert done.wait(30)
    assert box["r"].finish_reason["type"] == "abort" and 0 < len(box["r"].output_ids) < 200
    assert engine.num_running == 0


def test_unknown_sampling_keys_and_bad_values_are_rejected():
    with pytest.raises(ValueError, match=r"unknown sampling_params key\(s\) \['n'\]; allowed"):
        SamplingParams.from_json({"n": 2})
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingParams.from_json({"top_p": 0})
    with pytest.raises(ValueError, match="max_new_tokens must be int"):
        SamplingParams.from_json({"max_new_tokens": "8"})
