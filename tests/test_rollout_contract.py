"""Pins the SGLang 0.5.23 field names of DESIGN.md on both sides: every request the client
sends (recorded by a stand-in server, for the new and the old <= 0.5.20 API), and every
response the embedded server gives. If either drifts from SGLang, this fails."""

from __future__ import annotations

import asyncio

import pytest
from _rollout import embedded_servers, http, tiny_hf_dir
from aiohttp import web

from areal_mcore.rollout.client import ClientConfig, RolloutClient
from areal_mcore.rollout.launcher import free_port
from areal_mcore.rollout.protocol import SamplingParams

# Written out from DESIGN.md ("SGLang API subset to speak"), not imported from the code;
# load_format and destroy_weights_update_group are SGLang 0.5.23 fields DESIGN.md omits.
REQUEST_FIELDS = {
    ("GET", "/health"): set(), ("GET", "/model_info"): set(), ("GET", "/server_info"): set(),
    ("POST", "/generate"): {"input_ids", "sampling_params", "return_logprob", "rid"},
    ("POST", "/abort_request"): {"rid", "abort_all"},
    ("POST", "/pause_generation"): {"mode"},
    ("POST", "/continue_generation"): set(),
    ("POST", "/flush_cache"): set(),
    ("POST", "/init_weights_update_group"): {"master_address", "master_port", "rank_offset",
                                             "world_size", "group_name", "backend"},
    ("POST", "/begin_weight_update"): set(),
    ("POST", "/end_weight_update"): set(),
    ("POST", "/update_weights_from_distributed"): {"names", "dtypes", "shapes", "group_name",
                                                   "flush_cache", "abort_all_requests",
                                                   "weight_version", "load_format"},
    ("POST", "/destroy_weights_update_group"): {"group_name"},
    ("POST", "/update_weights_from_disk"): {"model_path", "weight_version", "abort_all_requests"},
}
OLD_ONLY = {("GET", "/get_server_info"): set(), ("GET", "/get_weight_version"): set()}
NEW_ONLY = {("GET", "/server_info"), ("GET", "/model_info"), ("POST", "/begin_weight_update"),
            ("POST", "/end_weight_update")}
SAMPLING_FIELDS = {"max_new_tokens", "temperature", "top_p", "top_k", "min_new_tokens",
                   "stop_token_ids", "ignore_eos", "sampling_seed"}
META_FIELDS = {"id", "finish_reason", "prompt_tokens", "completion_tokens", "weight_version",
               "output_token_logprobs"}


def _stand_in(version: str, seen: list):
    """A recording server answering like SGLang ``version``."""
    old = version == "0.5.20"

    async def handle(request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else {}
        key = (request.method, request.path)
        seen.append((key, body))
        if key in {("GET", "/server_info")} and old or key in OLD_ONLY and not old:
            return web.Response(status=404)
        if request.path.endswith("server_info"):
            return web.json_response({"version": version, "tp_size": 2})
        if request.path in ("/model_info", "/get_weight_version"):
            return web.json_response({"weight_version": "3"})
        if request.path == "/generate":
            return web.json_response({"output_ids": [4, 5], "meta_info": {
                "id": body["rid"], "finish_reason": {"type": "stop", "matched": 5},
                "prompt_tokens": 3, "completion_tokens": 2, "weight_version": "3",
                "output_token_logprobs": [[-0.5, 4, None], [-0.25, 5, None]]}})
        return web.json_response({"success": True, "message": "ok"})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    return app


async def _drive_client(version: str) -> tuple[list, object]:
    seen: list = []
    runner = web.AppRunner(_stand_in(version, seen))
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        async with RolloutClient(ClientConfig(addresses=[f"127.0.0.1:{port}"])) as client:
            c = await client.generate([1, 2, 3], SamplingParams(max_new_tokens=8, min_new_tokens=1,
                                      stop_token_ids=[5], sampling_seed=3, top_k=5, top_p=0.9))
            versions = await client.weight_versions()
            await client.pause(mode="abort")
            await client.continue_()
            await client.flush_cache()
            await client.abort("x")
            await client.abort_all()
            await client.init_weights_update_group(master_address="127.0.0.1", master_port=1,
                                                   group_name="g", backend="gloo")
            await client.begin_weight_update()
            await client.update_weights_from_distributed(names=["a"], dtypes=["bfloat16"],
                                                         shapes=[[2]], group_name="g",
                                                         weight_version="4")
            await client.end_weight_update()
            await client.destroy_weights_update_group("g")
            await client.update_weights_from_disk("/x", weight_version="5")
            world = client.weight_group_world_size()
    finally:
        await runner.cleanup()
    return seen, (c, versions, world)


@pytest.mark.parametrize("version", ["0.5.23", "0.5.20"])
def test_client_sends_only_sglang_field_names(version):
    seen, (c, versions, world) = asyncio.run(_drive_client(version))
    allowed = {**REQUEST_FIELDS, **OLD_ONLY}
    for key, body in seen:
        assert key in allowed, f"client called {key}, which is not in the pinned API"
        assert set(body) <= allowed[key], (key, set(body) - allowed[key])
        if key == ("POST", "/generate"):
            assert set(body["sampling_params"]) <= SAMPLING_FIELDS
    called = {k for k, _ in seen}
    if version == "0.5.20":  # old API: no begin/end, weight version from /get_weight_version
        assert not called & (NEW_ONLY - {("GET", "/server_info")})
        assert ("GET", "/get_weight_version") in called
    else:
        assert {("POST", "/begin_weight_update"), ("GET", "/model_info")} <= called
        assert not called & set(OLD_ONLY)
    assert c.output_ids == [4, 5] and c.logprobs == [-0.5, -0.25] and c.versions == ["3", "3"]
    assert versions == ["3"] and world == 3  # trainer + a TP-2 server
    inits = [b for k, b in seen if k[1] == "/init_weights_update_group"]
    assert inits == [{"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                      "world_size": 3, "group_name": "g", "backend": "gloo"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = tiny_hf_dir(str(tmp_path_factory.mktemp("hf")), seed=2)
    with embedded_servers(model, str(tmp_path_factory.mktemp("logs"))) as s:
        yield s[0]


def test_embedded_server_answers_with_sglang_field_names(server):
    a = server.address
    assert http(a, "GET", "/health")[0] == 200
    for path in ("/model_info", "/get_model_info"):
        status, info = http(a, "GET", path)
        assert status == 200 and {"model_path", "is_generation", "weight_version"} <= set(info)
    status, info = http(a, "GET", "/server_info")
    assert status == 200 and info["version"] == "0.5.23"

    sampling = {"max_new_tokens": 6, "temperature": 1.0, "top_p": 0.9, "top_k": 20,
                "min_new_tokens": 2, "stop_token_ids": [3], "ignore_eos": False, "sampling_seed": 1}
    assert set(sampling) == SAMPLING_FIELDS
    status, out = http(a, "POST", "/generate", {"input_ids": [1, 2, 3], "sampling_params": sampling,
                                                "return_logprob": True, "rid": "contract-1"})
    assert status == 200 and set(out) == {"output_ids", "meta_info"}
    meta = out["meta_info"]
    assert META_FIELDS <= set(meta) and meta["id"] == "contract-1"
    assert meta["finish_reason"]["type"] in ("stop", "length", "abort")
    assert meta["prompt_tokens"] == 3 and meta["completion_tokens"] == len(out["output_ids"])
    assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]
    assert all(isinstance(lp, float) and top is None for lp, _, top in meta["output_token_logprobs"])

    status, err = http(a, "POST", "/generate", {"input_ids": [1], "sampling_params": {"n": 2}})
    assert status == 400 and "unknown sampling_params key(s) ['n']" in err["message"]
    for path, body in [("/abort_request", {"rid": "none"}), ("/abort_request", {"abort_all": True}),
                       ("/pause_generation", {"mode": "abort"}), ("/continue_generation", {}),
                       ("/flush_cache", None), ("/begin_weight_update", {}), ("/end_weight_update", {})]:
        assert http(a, "POST", path, body)[0] == 200, path
    status, out = http(a, "POST", "/update_weights_from_distributed", {
        "names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[1, 1]], "group_name": "none"})
    assert status == 400 and set(out) == {"success", "message"} and out["success"] is False
