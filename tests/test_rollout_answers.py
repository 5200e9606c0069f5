"""Every server answer is checked at the client boundary (fast: no server process).

The generate contract (``Engine.read_generate`` / ``Chunk.check``) against each
corruption ``tests/_proxy.py`` injects, in SGLang's and vLLM's shapes; JSON that is not
JSON (``Fleet.request``); malformed control answers; and the client failing over from a
lying stand-in server, taking it out after ``max_bad_answers`` and naming it when no
other is left. The same against real servers behind the proxy: test_rollout_client.py
(embedded) and test_vllm.py (vLLM).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math

import pytest
from _proxy import CORRUPTIONS, FaultProxy, corrupt

from areal_mcore.rollout.client import ClientConfig, RolloutClient
from areal_mcore.rollout.engines import engine_for
from areal_mcore.rollout.fleet import BadAnswer, Fleet, Server, TransientError
from areal_mcore.rollout.protocol import RolloutError, SamplingParams

VOCAB, PADDED = 100, 128
SERVER = Server("127.0.0.1:9")


def _good(backend: str) -> dict:
    """A 3-token answer as each engine writes it."""
    if backend == "vllm":  # GenerateResponse (token_in_token_out/protocol.py)
        return {"request_id": "r", "choices": [{
            "index": 0, "finish_reason": "length", "stop_reason": None, "token_ids": [4, 5, 6],
            "logprobs": {"content": [{"token_id": t, "logprob": -0.5} for t in (4, 5, 6)]},
            "weight_versions": [{"version": "1", "start": 0, "end": 3}]}]}
    return {"output_ids": [4, 5, 6], "meta_info": {  # TokenizerManager's, return_logprob
        "id": "r", "finish_reason": {"type": "length", "length": 3}, "weight_version": "1",
        "output_token_logprobs": [[-0.5, t, None] for t in (4, 5, 6)]}}


def _read(backend: str, out, requested: int = 3):
    return engine_for(backend).read_generate(SERVER, out, requested, vocab_size=VOCAB)


@pytest.mark.parametrize("backend", ["sglang", "vllm"])
def test_a_good_answer_passes_and_minus_inf_is_kept_for_the_loss_to_mask(backend):
    chunk = _read(backend, _good(backend))
    assert chunk.output_ids == [4, 5, 6] and chunk.logprobs == [-0.5] * 3
    assert chunk.versions == ["1"] * 3 and chunk.finish_reason["type"] == "length"
    ok = json.loads(json.dumps(_good(backend)).replace("-0.5", "-Infinity", 1))
    assert _read(backend, ok).logprobs[0] == -math.inf


WHAT = {"empty": "an empty body", "no_meta": "meta_info is missing", "count": "3 output_ids but",
        "nan": "is nan", "past_padded": f"id {PADDED}, outside the served model's vocabulary [0, {VOCAB})",
        "negative": "id -1, outside", "gap": f"id {VOCAB}, outside the served model's vocabulary"}
WHAT_VLLM = {**WHAT, "no_meta": "choices is NoneType", "count": "3 token_ids but logprobs.content"}


@pytest.mark.parametrize("backend", ["sglang", "vllm"])
@pytest.mark.parametrize("mode", [m for m in CORRUPTIONS if m != "malformed_json"])
def test_each_corruption_is_a_bad_answer_naming_the_server_and_the_fault(backend, mode):
    body = corrupt(_good(backend), mode, backend, vocab=VOCAB, padded_vocab=PADDED)
    with pytest.raises(BadAnswer) as e:
        _read(backend, json.loads(body) if body else "")
    assert str(e.value).startswith(f"{SERVER.address}: bad {backend} generate answer: ")
    assert (WHAT_VLLM if backend == "vllm" else WHAT)[mode] in str(e.value), str(e.value)
    assert isinstance(e.value, TransientError) and e.value.failed == [SERVER.address]


@pytest.mark.parametrize("answer, what", [
    ({**_good("sglang"), "output_ids": [4, 5, 7]}, "output token 2 is 7 in output_ids but 6"),
    ({"output_ids": [4, 5, 6], "meta_info": {**_good("sglang")["meta_info"], "output_token_logprobs":
                                             [[None, t, None] for t in (4, 5, 6)]}}, "is null"),
    ({"output_ids": [4, 5, 6], "meta_info": {**_good("sglang")["meta_info"], "finish_reason": None}},
     "finish_reason None"),
    ({"output_ids": [4, 5, 6], "meta_info": {**_good("sglang")["meta_info"], "weight_version": None}},
     "neither weight_version"),
    ({"output_ids": [4, "5", 6], "meta_info": {**_good("sglang")["meta_info"], "output_token_logprobs":
                                               [[-0.5, t, None] for t in (4, "5", 6)]}}, "not an int"),
    ([_good("sglang")], "a list of 1, not a JSON object"),
])
def test_sglangs_own_shape_is_checked_field_by_field(answer, what):
    with pytest.raises(BadAnswer, match="bad sglang generate answer") as e:
        _read("sglang", answer)
    assert what in str(e.value)


def test_more_tokens_than_asked_for_is_a_bad_answer():
    # The next resubmission would ask for a negative number of tokens.
    with pytest.raises(BadAnswer, match="4 output tokens for the 3 asked for"):
        _read("sglang", {"output_ids": [1] * 4, "meta_info": {
            **_good("sglang")["meta_info"], "output_token_logprobs": [[-0.5, 1, None]] * 4}})


def test_vllms_nan_stand_in_and_mismatched_ids_are_bad_answers():
    out = _good("vllm")
    out["choices"][0]["logprobs"]["content"][1]["logprob"] = -9999.0  # _clamp_logprob's NaN
    with pytest.raises(BadAnswer, match="output token 1 is -9999.0"):
        _read("vllm", out)
    out = _good("vllm")
    out["choices"][0]["logprobs"]["content"][2]["token_id"] = 9
    with pytest.raises(BadAnswer, match="output token 2 is 6 in token_ids but 9"):
        _read("vllm", out)


def test_without_a_known_vocabulary_only_negative_ids_are_refused():
    body = corrupt(_good("sglang"), "past_padded", "sglang", vocab=VOCAB, padded_vocab=PADDED)
    assert engine_for("sglang").read_generate(SERVER, json.loads(body), 3).output_ids[0] == PADDED
    body = corrupt(_good("sglang"), "negative", "sglang", vocab=VOCAB, padded_vocab=PADDED)
    with pytest.raises(BadAnswer, match="a negative id"):
        engine_for("sglang").read_generate(SERVER, json.loads(body), 3)


def _app(*, generate_body: bytes | None = None, model_info=None, server_info=None):
    """A stand-in SGLang server: answers for /generate, /model_info and /server_info."""
    from aiohttp import web

    async def generate(request):
        body = await request.json()
        if generate_body is not None:
            return web.Response(body=generate_body, content_type="application/json")
        n = body["sampling_params"]["max_new_tokens"]
        ids = [(body["input_ids"][0] + i) % VOCAB for i in range(n)]
        return web.json_response({"output_ids": ids, "meta_info": {
            "id": body["rid"], "finish_reason": {"type": "length", "length": n}, "weight_version": "0",
            "output_token_logprobs": [[-1.0, t, None] for t in ids]}})

    async def info(request):
        return server_info if server_info is not None else web.json_response({"version": "0.5.23"})

    async def health(request):
        return web.Response()

    async def model(request):
        return model_info if model_info is not None else web.json_response({"weight_version": "0"})

    app = web.Application()
    app.router.add_post("/generate", generate)
    app.router.add_get("/server_info", info)
    app.router.add_get("/model_info", model)
    app.router.add_get("/health", health)
    return app


async def _serve(apps):
    from test_rollout_client import _serve as serve

    return await serve(apps)


def test_a_body_that_is_not_json_is_a_server_fault_never_a_value_error():
    async def run():
        runners, (address,) = await _serve([_app(generate_body=b'{"output_ids": [1, 2')])
        try:
            async with Fleet([address]) as fleet:
                with pytest.raises(BadAnswer) as e:
                    await fleet.request(fleet.servers[0], "POST", "/generate", {"input_ids": [1], "rid": "r",
                                        "sampling_params": {"max_new_tokens": 1}}, timeout=10, control=False)
            return address, e.value
        finally:
            for r in runners:
                await r.cleanup()

    address, err = asyncio.run(run())
    assert not isinstance(err, ValueError) and isinstance(err, RolloutError)
    assert str(err).startswith(f"{address}/generate: HTTP 200 with a body that is not JSON (")


def test_malformed_control_answers_raise_rollout_errors_naming_the_server():
    from aiohttp import web

    async def run():
        apps = [_app(model_info=web.json_response({"version": "3"}),
                     server_info=web.json_response({"version": "0.5.23", "tp_size": "two"})),
                _app(model_info=web.Response(text='{"weight_version": ', content_type="application/json"),
                     server_info=web.Response(text="[1, 2]", content_type="application/json"))]
        runners, addresses = await _serve(apps)
        errors = []
        try:
            for address in addresses:
                client = RolloutClient(ClientConfig(addresses=[address]))
                await client.fleet.start()
                try:
                    for call in (client.engine.detect_all(client.fleet), client.weight_versions()):
                        with pytest.raises(RolloutError) as e:
                            await call
                        errors.append(e.value)
                finally:
                    await client.fleet.close()
        finally:
            for r in runners:
                await r.cleanup()
        return addresses, errors

    (a, b), errors = asyncio.run(run())
    assert [type(e) for e in errors if not isinstance(e, RolloutError) or isinstance(e, ValueError)] == []
    assert f"{a}/server_info: the answer's 'tp_size' is str 'two'" in str(errors[0])
    assert f"{a}/model_info: the answer's 'weight_version' is missing" in str(errors[1])
    assert f"{b}/server_info: answered a list of 2, not a JSON object" in str(errors[2])
    assert f"{b}/model_info: HTTP 200 with a body that is not JSON" in str(errors[3])


def test_a_lying_server_is_failed_over_taken_out_and_named_when_alone(caplog):
    """Behind the proxy, a stand-in lies in every answer; a clean one beside it serves
    every request. After max_bad_answers the liar is faulty: out of generation, reported
    gone to the weight syncer, and health probes do not bring it back."""
    sampling = SamplingParams(max_new_tokens=3)

    async def run():
        runners, (address,) = await _serve([_app()])
        try:
            async with FaultProxy(address, vocab=VOCAB, padded_vocab=PADDED) as proxy:
                cfg = ClientConfig(addresses=[proxy.address, address], retry_delay_s=0.01, vocab_size=VOCAB)
                async with RolloutClient(cfg) as client:
                    outs = [await client.generate([i + 1, 2], sampling, rid=f"r{i}") for i in range(8)]
                    liar = client.fleet.servers[0]
                    await client.fleet.check_health()
                    state = (liar.faulty, liar.healthy, liar.answers, await client.fleet.gone_servers())
                async with RolloutClient(ClientConfig(addresses=[proxy.address], retry_delay_s=0.01,
                                                      vocab_size=VOCAB)) as alone:
                    with pytest.raises(RolloutError) as e:
                        await alone.generate([1, 2], sampling, rid="x")
                return proxy, outs, state, e.value
        finally:
            for r in runners:
                await r.cleanup()

    with caplog.at_level(logging.WARNING, logger="areal_mcore.rollout.client"):
        proxy, outs, (faulty, healthy, answers, gone), err = asyncio.run(run())
    assert all(o.output_ids == [(i + 1 + k) % VOCAB for k in range(3)] and o.logprobs == [-1.0] * 3
               for i, o in enumerate(outs))
    assert faulty and not healthy and answers == 3 and gone == [proxy.address]
    assert sum(o.attempts for o in outs) == 3  # the liar's 3 answers, then none went there
    failures = [r.getMessage() for r in caplog.records if "failed on" in r.getMessage()]
    assert len(failures) == 6 and all(proxy.address in m for m in failures)
    assert any(f"rollout server {proxy.address} is faulty: 3 bad answers" in r.getMessage()
               for r in caplog.records)
    assert not isinstance(err, ValueError) and proxy.address in str(err), str(err)
    assert "faulty for bad answers" in str(err) and "bad sglang generate answer" in str(err)
