"""Our side of SGLang's API, checked by SGLang's own code (from its 0.5.23 and 0.5.20
wheels, see tests/_sglang.py): every request the client sends is recorded by a stand-in
and then validated the way SGLang's HTTP server validates it (its route table, its request
structs through pydantic as FastAPI does, its ``/generate`` contract gate and its
``SamplingParams`` normalise/verify); the weight-update group is formed with our trainer
code, SGLang's ``init_custom_process_group`` and the embedded server's recipe on three
processes, and SGLang's own bucket code decodes what our syncer packed. The embedded
server's responses are pinned to the field names of docs/sglang_api.md."""

from __future__ import annotations

import ast
import asyncio
import base64
import importlib
import re

import numpy as np
import pytest
import torch
from _rollout import embedded_servers, http, tiny_hf_dir
from _sglang import definitions, init_custom_process_group, source, wheel_modules
from aiohttp import web

from areal_mcore.net import free_port
from areal_mcore.rollout.client import ClientConfig, RolloutClient
from areal_mcore.rollout.protocol import SamplingParams

# The HTTP route -> SGLang's request struct for its JSON body (http_server.py handlers).
# [tokens - 1, layers, top_k] of a 3-token prompt + 2 tokens (SGLang's meta_info.routed_experts)
ROUTED = np.arange(4 * 3 * 2, dtype=np.int32).reshape(4, 3, 2)
STRUCTS = {
    "/abort_request": "AbortReq", "/pause_generation": "PauseGenerationReqInput",
    "/continue_generation": "ContinueGenerationReqInput",
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
    "/begin_weight_update": "BeginWeightUpdateReqInput",
    "/end_weight_update": "EndWeightUpdateReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
}
META_FIELDS = {"id", "finish_reason", "prompt_tokens", "completion_tokens", "weight_version",
               "output_token_logprobs", "weight_versions"}
VOCAB = 256


def sglang_routes(version: str) -> set[tuple[str, str]]:
    """(method, path) of every route in that version's ``entrypoints/http_server.py``."""
    text = source(version, "srt/entrypoints/http_server.py")
    routes = {(m.upper(), p) for m, p in re.findall(r'@app\.(get|post|put)\(\s*"([^"]+)"', text)}
    for path, methods in re.findall(r'@app\.api_route\(\s*"([^"]+)",\s*methods=\[([^\]]*)\]', text):
        routes |= {(m.strip(' "\''), path) for m in methods.split(",")}
    return routes


class SGLang:
    """One version's request validation, built from its wheel."""

    def __init__(self, version: str):
        from pydantic import TypeAdapter

        self.version = version
        with wheel_modules(version):
            msgspec_utils = importlib.import_module("sglang.srt.utils.msgspec_utils")
            self.SamplingParams = importlib.import_module(
                "sglang.srt.sampling.sampling_params").SamplingParams
            try:  # 0.5.23: /generate bodies pass a schema gate before the dataclass
                self.gate = importlib.import_module("sglang.api.v1.api_types").GenerateRequest
            except ImportError:
                self.gate = None
        namespace = _typing_namespace()
        namespace["msgspec_struct_pydantic_core_schema"] = \
            msgspec_utils.msgspec_struct_pydantic_core_schema
        text = source(version, "srt/managers/io_struct.py")
        present = {n.name for n in ast.parse(text).body if isinstance(n, ast.ClassDef)}
        wanted = {path: name for path, name in STRUCTS.items() if name in present}
        mod = definitions(version, "srt/managers/io_struct.py", ["BaseReq", *wanted.values()],
                          namespace, f"_sglang_io_struct_{version.replace('.', '_')}")
        self.structs = {path: getattr(mod, name) for path, name in wanted.items()}
        self.adapters = {path: TypeAdapter(cls) for path, cls in self.structs.items()}
        self.generate_fields = _class_fields(text, "GenerateReqInput")
        self.routes = sglang_routes(version)

    def validate(self, method: str, path: str, body: dict | None) -> None:
        assert (method, path) in self.routes, f"SGLang {self.version} has no {method} {path}"
        if path == "/generate":
            assert set(body) <= self.generate_fields, set(body) - self.generate_fields
            if self.gate is not None:
                self.gate.from_json_value(body)
            params = self.SamplingParams(**body["sampling_params"])
            params.normalize(None)  # skip_tokenizer_init: no tokenizer
            params.verify(VOCAB)
        elif path in self.structs:
            import msgspec

            cls = self.structs[path]
            fields = ({f.name for f in msgspec.structs.fields(cls)} if issubclass(cls, msgspec.Struct)
                      else set(cls.__dataclass_fields__))
            # FastAPI ignores unknown keys: a misspelt one would be dropped silently.
            assert set(body or {}) <= fields, (path, set(body or {}) - fields)
            self.adapters[path].validate_python(body or {})
        else:
            assert not body, (path, body)


def _typing_namespace() -> dict:
    import typing
    import uuid
    from abc import ABC
    from collections import Counter
    from dataclasses import dataclass, field

    import msgspec

    names = {n: getattr(typing, n) for n in ("Any", "Dict", "List", "Literal", "Optional",
                                              "Tuple", "Union", "Annotated")}
    # Types of fields our requests never set (they stay None); resolved only as Any.
    opaque = {n: typing.Any for n in ("FinishReasonDict", "WeightVersionSpans",
                                       "ExpertWeightPointer")}
    return {**names, **opaque, "msgspec": msgspec, "dataclass": dataclass, "field": field,
            "uuid": uuid, "Counter": Counter, "ABC": ABC}


def _class_fields(text: str, name: str) -> set[str]:
    cls = next(n for n in ast.parse(text).body if getattr(n, "name", None) == name)
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)}


@pytest.fixture(scope="module", params=["0.5.23", "0.5.20"])
def sglang(request):
    return SGLang(request.param)


def _stand_in(sglang: SGLang, seen: list):
    """Records each request and answers as that SGLang version's route table does."""

    async def handle(request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else None
        key = (request.method, request.path)
        seen.append((key, body))
        if key not in sglang.routes or request.path == "/get_weight_version":
            return web.Response(status=404)  # 0.5.10-0.5.20 answer 404 there too
        if request.path.endswith("server_info"):
            return web.json_response({"version": sglang.version, "tp_size": 2, "dp_size": 1})
        if request.path == "/model_info":
            return web.json_response({"weight_version": "3"})
        if request.path == "/generate":
            meta = {"id": body["rid"], "finish_reason": {"type": "stop", "matched": 5},
                    "prompt_tokens": 3, "completion_tokens": 2, "weight_version": "3",
                    "weight_versions": [{"version": "2", "start": 0, "end": 1},
                                        {"version": "3", "start": 1, "end": 2}],
                    "output_token_logprobs": [[-0.5, 4, None], [-0.25, 5, None]]}
            if body.get("return_routed_experts"):  # TokenizerManager: b64 of the int32 bytes
                meta["routed_experts"] = base64.b64encode(ROUTED.tobytes()).decode()
            return web.json_response({"output_ids": [4, 5], "meta_info": meta})
        return web.json_response({"success": True, "message": "ok"})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    return app


async def _drive_client(sglang: SGLang) -> tuple[list, tuple]:
    seen: list = []
    runner = web.AppRunner(_stand_in(sglang, seen))
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        async with RolloutClient(ClientConfig(addresses=[f"127.0.0.1:{port}"])) as client:
            c = await client.generate([1, 2, 3], SamplingParams(
                max_new_tokens=8, stop_token_ids=[5], sampling_seed=3, top_k=5, top_p=0.9,
                temperature=0.7))
            versions = await client.weight_versions()
        routed_cfg = ClientConfig(addresses=[f"127.0.0.1:{port}"], return_routed_experts=True)
        async with RolloutClient(routed_cfg) as client:  # MoE routing asked for (server.return_routed_experts)
            routed = await client.generate([1, 2, 3], SamplingParams(max_new_tokens=8))
        async with RolloutClient(ClientConfig(addresses=[f"127.0.0.1:{port}"])) as client:
            for mode in ("abort", "retract", "in_place"):
                await client.pause(mode=mode)
            await client.continue_()
            await client.engine.flush_cache(client.fleet)
            await client.abort_all()
            # The weight update as the syncer drives it (weight_sync/distributed.py, disk.py).
            updater = client.engine.updater(client.fleet)
            group = updater.group_spec(master_address="127.0.0.1", master_port=1, group_name="g",
                                       backend="gloo")
            await updater.init_group(group)
            await updater.begin("abort")
            for flatten in (False, True):
                await updater.receive_bucket(names=["a"], dtypes=["bfloat16"], shapes=[[2]],
                                             group=group, flatten=flatten, weight_version="4")
            await updater.finish("abort", "4")
            await updater.end(best_effort=True)
            await updater.destroy_group(group)
            await updater.from_disk("/x", "5", "abort")
            world = group.world_size
    finally:
        await runner.cleanup()
    return seen, (c, versions, world, routed)


def test_every_request_the_client_sends_is_accepted_by_sglangs_own_validation(sglang):
    seen, (c, versions, world, routed) = asyncio.run(_drive_client(sglang))
    for (method, path), body in seen:
        sglang.validate(method, path, body)
    called = {path for (_, path), _ in seen}
    assert "/get_weight_version" not in called  # a 404 on every version
    if sglang.version == "0.5.20":  # no update sessions in the old API
        assert not called & {"/begin_weight_update", "/end_weight_update"}
    else:
        assert {"/begin_weight_update", "/end_weight_update"} <= called
    assert c.output_ids == [4, 5] and c.logprobs == [-0.5, -0.25]
    assert c.versions == ["2", "3"]  # per-token versions from the spans
    assert versions == ["3"] and world == 3  # trainer + a TP-2 server
    assert c.routed_experts is None and np.array_equal(routed.routed_experts, ROUTED.reshape(-1))
    assert [b.get("return_routed_experts") for (_, p), b in seen if p == "/generate"] == [None, True]
    inits = [b for (_, p), b in seen if p == "/init_weights_update_group"]
    assert inits == [{"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                      "world_size": 3, "group_name": "g", "backend": "gloo"}]


def test_sglang_validation_catches_what_it_should(sglang):
    """The checks above can fail: SGLang refuses these bodies (or we would lose a key)."""
    with pytest.raises(ValueError, match="min_new_tokens=2 is unavailable"):
        sglang.validate("POST", "/generate", {"input_ids": [1], "sampling_params": {
            "max_new_tokens": 4, "min_new_tokens": 2}})
    with pytest.raises(ValueError):
        sglang.validate("POST", "/pause_generation", {"mode": "sideways"})
    with pytest.raises(AssertionError):
        sglang.validate("POST", "/update_weights_from_distributed", {
            "names": ["a"], "dtypes": ["bfloat16"], "shapes": [[2]], "group": "g"})
    with pytest.raises(AssertionError, match="has no GET /get_server_infos"):
        sglang.validate("GET", "/get_server_infos", None)


# ---- the weight-update group, three implementations in three processes ---------------

BUCKET = [("model.embed_tokens.weight", [6, 4]), ("model.norm.weight", [4]),
          ("lm_head.weight", [6, 4])]


def _bucket_tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randn(shape, generator=g) for _, shape in BUCKET]


def _trainer(port: int, name: str, queue) -> None:
    import os

    # What torchrun sets for its workers (the trainer always runs under it): torch's
    # rendezvous would then join the agent's store instead of hosting the group's.
    os.environ.update(TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="0")
    from areal_mcore.rollout.weights import ReusableBuffer
    from areal_mcore.weight_sync.distributed import pack_bucket
    from areal_mcore.weight_sync.group import destroy_update_group, init_update_group

    pg = init_update_group(master_address="127.0.0.1", master_port=port, world_size=3,
                           group_name=name, backend="gloo", timeout_s=60)
    [payload] = pack_bucket(ReusableBuffer(), _bucket_tensors(), [s for _, s in BUCKET],
                            torch.bfloat16, flatten=True)
    pg.broadcast(payload, 0).wait()
    destroy_update_group(pg)
    queue.put(("trainer", payload.dtype == torch.uint8))


def _sglang_server(port: int, name: str, queue) -> None:
    import torch.distributed as dist

    init = init_custom_process_group("0.5.23")
    with wheel_modules("0.5.23"):
        bucket_cls = importlib.import_module(
            "sglang.srt.weight_sync.tensor_bucket").FlattenedTensorBucket
    pg = init(backend="gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=3, rank=1,
              group_name=name)
    # SGLang's _receive_bucketed_weights_from_distributed, step by step.
    bucket = bucket_cls.empty([n for n, _ in BUCKET], ["bfloat16"] * len(BUCKET),
                              [s for _, s in BUCKET], "cpu")
    dist.broadcast(bucket.get_flattened_tensor(), src=0, group=pg)
    got = bucket.reconstruct_tensors()
    want = [t.to(torch.bfloat16) for t in _bucket_tensors()]
    ok = [n for n, _ in got] == [n for n, _ in BUCKET] and all(
        g.dtype == torch.bfloat16 and torch.equal(g.view(torch.int16), w.view(torch.int16))
        for (_, g), w in zip(got, want))
    queue.put(("sglang", ok))


def _embedded(port: int, name: str, queue) -> None:
    from areal_mcore.rollout.embedded.server import join_group
    from areal_mcore.rollout.weights import ReusableBuffer, receive_flat

    pg = join_group(master_address="127.0.0.1", master_port=port, rank=2, world_size=3,
                    group_name=name, backend="gloo", timeout_s=60)
    got = receive_flat(pg, ReusableBuffer(), [n for n, _ in BUCKET], ["bfloat16"] * len(BUCKET),
                       [s for _, s in BUCKET])
    want = [t.to(torch.bfloat16) for t in _bucket_tensors()]
    queue.put(("embedded", all(torch.equal(g, w) for (_, g), w in zip(got, want))))


def test_update_group_forms_with_sglangs_own_recipe_and_its_bucket_code_decodes_ours():
    import torch.multiprocessing as mp
    from _sglang import wheel

    wheel("0.5.23")  # skip/fail here, not in a child
    ctx = mp.get_context("spawn")
    queue, port, name = ctx.Queue(), free_port(), "areal_weight_sync_pp0_c0ffee00"
    procs = [ctx.Process(target=f, args=(port, name, queue))
             for f in (_trainer, _sglang_server, _embedded)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    assert results == {"trainer": True, "sglang": True, "embedded": True}


# ---- the embedded server answers like SGLang -------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = tiny_hf_dir(str(tmp_path_factory.mktemp("hf")), seed=2)
    with embedded_servers(model, str(tmp_path_factory.mktemp("logs"))) as s:
        yield s[0]


@pytest.mark.server
def test_embedded_server_answers_with_sglang_field_names(server):
    a = server.address
    assert http(a, "GET", "/health")[0] == 200
    for path in ("/model_info", "/get_model_info"):
        status, info = http(a, "GET", path)
        assert status == 200 and {"model_path", "is_generation", "weight_version"} <= set(info)
    status, info = http(a, "GET", "/server_info")
    assert status == 200 and info["version"] == "0.5.23"
    assert (info["tp_size"], info["dp_size"], info["pp_size"]) == (1, 1, 1)
    assert http(a, "GET", "/get_weight_version")[0] == 404  # as on every SGLang version

    sampling = {"max_new_tokens": 6, "temperature": 1.0, "top_p": 0.9, "top_k": 20,
                "stop_token_ids": [3], "ignore_eos": False, "sampling_seed": 1}
    status, out = http(a, "POST", "/generate", {"input_ids": [1, 2, 3], "sampling_params": sampling,
                                                "return_logprob": True, "rid": "contract-1"})
    assert status == 200 and set(out) == {"output_ids", "meta_info"}
    meta = out["meta_info"]
    assert META_FIELDS <= set(meta) and meta["id"] == "contract-1"
    assert meta["finish_reason"]["type"] in ("stop", "length", "abort")
    assert meta["prompt_tokens"] == 3 and meta["completion_tokens"] == len(out["output_ids"])
    assert meta["weight_versions"] == [{"version": "default", "start": 0,
                                        "end": len(out["output_ids"])}]
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


@pytest.mark.server
def test_bad_answers_through_a_corrupting_proxy_fail_over_and_take_the_server_out(server, caplog):
    """The module's embedded server, reached through tests/_proxy.py (every answer
    corrupted, round robin through malformed JSON, an empty body, no meta_info, a logprob
    short, a NaN, ids past the padded vocabulary, -1 and in the padded-vocabulary gap)
    and directly; ``drill`` there says what each phase checks."""
    import logging

    from _proxy import check_drill, drill

    from areal_mcore.model.args import padded_vocab_size
    from areal_mcore.rollout.client import served_vocab_size

    vocab = served_vocab_size(server.cmd[server.cmd.index("--model-path") + 1])
    assert vocab == 250  # tiny_model's, padded to 256 by the trainer: a gap of 6 ids
    with caplog.at_level(logging.WARNING, logger="areal_mcore.rollout.client"):
        seen = asyncio.run(drill(server.address, server.address, backend="embedded", vocab=vocab,
                                 padded_vocab=padded_vocab_size(vocab, 1)))
    check_drill(seen, caplog.records)


@pytest.mark.server
def test_embedded_old_api_routes_are_a_subset_of_sglang_0_5_20s(tmp_path):
    """``--sglang-api 0.5.20`` serves no route 0.5.20 lacks, and none of the session routes."""
    model = tiny_hf_dir(str(tmp_path), seed=2)
    routes = sglang_routes("0.5.20")
    with embedded_servers(model, str(tmp_path / "logs"), extra_args=["--sglang-api", "0.5.20"]) as s:
        a = s[0].address
        assert http(a, "GET", "/server_info")[1]["version"] == "0.5.20"
        assert http(a, "POST", "/begin_weight_update", {})[0] == 404
        assert ("POST", "/begin_weight_update") not in routes
        status, out = http(a, "GET", "/get_weight_version")
        assert status == 404 and "use '/model_info'" in out["detail"]
        assert ("GET", "/get_weight_version") in routes  # it exists there, and answers 404
    from areal_mcore.rollout.embedded.server import ServerArgs, build_app

    class _Engine:
        pass

    app = build_app(ServerArgs(model_path="x", sglang_api="0.5.20"), _Engine(), None)
    ours = {(r.method, r.resource.canonical) for r in app.router.routes() if r.method != "HEAD"}
    ours = {(m, p) for m, p in ours for m in (["GET", "POST"] if m == "*" else [m])}
    assert ours <= routes, ours - routes
