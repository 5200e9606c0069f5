"""Embedded rollout server: SGLang's HTTP API (the subset in docs/sglang_api.md) over a transformers
model on CPU, so the whole RL loop runs where SGLang cannot.

    python -m areal_mcore.rollout.embedded.server --model-path HF_DIR --port 30000

Runs with SGLang's ``skip_tokenizer_init`` semantics: token ids in, token ids out. It
keeps SGLang's rules, refusals included, so that tests against it fail where SGLang would:
one weight-update session at a time (``--sglang-api 0.5.23``; 0.5.20 has no sessions and
no begin/end routes), control calls served one at a time on the engine thread (an
``init_weights_update_group`` blocks everything until its group forms), the update group
formed with SGLang's recipe, flattened buckets received as ``uint8``, ``flush_cache``
refused while requests run, ``min_new_tokens`` refused without a tokenizer.

MoE routing as SGLang 0.5.23 returns it: started with ``--enable-return-routed-experts``, a
request with ``"return_routed_experts": true`` gets ``meta_info.routed_experts``, base64 of
the int32 bytes of [tokens - 1, num_hidden_layers, top_k] (every token but the last sampled
one; from ``routed_experts_start_len`` on), which SGLang's
``extract_routed_experts_from_meta_info`` (state_capturer/routed_experts.py) decodes.

Fault injection for tests (never set in production): ``--fail-update N`` makes the N-th
``update_weights_from_distributed`` receive its tensors and then fail, as a failed load
does in SGLang; ``--die-at-update N`` SIGKILLs the server when the N-th arrives (a node
lost mid-update, before that bucket's broadcast); ``--refuse-update N`` answers the N-th
with a refusal before its receive (as a request that fails validation is);
``--stall-after N`` never answers the generate requests after the N-th (a stalled engine);
``--step-delay-s S`` sleeps S after every decode step (a slow engine that still answers);
``--perturb-weights STD`` multiplies every weight an update loads (from the trainer or from
disk) by (1 + STD · N(0, 1)) and reports success (an engine that serves other weights than it
was sent: a bad cast, shard or load, which the trainer's drift alarm must catch);
``--refuse-group-init`` refuses every
update-group init at once; ``--delay-group-init SUBSTR=SECONDS`` holds init calls whose group name
contains SUBSTR before they queue (to force an arrival order between servers).

Access (docs/rollout.md#security): with ``$AREAL_ROLLOUT_API_KEY`` set, every route but
``/health`` needs ``Authorization: Bearer KEY`` (from the environment, never a flag: ``ps``
shows a command line to every user of the node); with ``--weights-root DIR``,
``update_weights_from_disk`` loads from under DIR only.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import datetime
import logging
import os
import secrets
import signal
import uuid
from dataclasses import dataclass

import torch
import torch.distributed as dist
from aiohttp import web

from areal_mcore.convert.hf_files import load_hf_state_dict
from areal_mcore.rollout import weights as W
from areal_mcore.rollout.auth import KEY_ENV, within
from areal_mcore.rollout.embedded.engine import DecodeEngine, Request
from areal_mcore.rollout.protocol import SGLANG_API_VERSION, SamplingParams

log = logging.getLogger("areal_mcore.rollout.embedded.server")
ENGINE_KEY = web.AppKey("engine", DecodeEngine)
STATE_KEY = web.AppKey("state", object)


@dataclass(kw_only=True)
class ServerArgs:
    model_path: str
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None  # from $AREAL_ROLLOUT_API_KEY (parse_args)
    weights_root: str | None = None  # update_weights_from_disk loads from under it only; None: anywhere
    random_seed: int = 0
    dtype: str = "float32"
    context_length: int | None = None
    max_running_requests: int = 64
    weight_version: str = "default"
    sglang_api: str = SGLANG_API_VERSION  # or "0.5.20": the old API (no update sessions)
    fail_update: int = 0  # fault injection (see the module docstring); 0: off
    die_at_update: int = 0  # fault injection: 0: off
    refuse_update: int = 0  # fault injection: 0: off
    refuse_group_init: bool = False  # fault injection
    delay_group_init: str | None = None  # fault injection: "SUBSTR=SECONDS"
    stall_after: int = 0  # fault injection: generate requests after the N-th never start; 0: off
    step_delay_s: float = 0.0  # fault injection: a sleep after each decode step; 0: off
    perturb_weights: float = 0.0  # fault injection: relative noise on loaded weights; 0: off
    sigstop_at: str | None = None  # fault injection: "ROUTE:N", SIGSTOP at its N-th request
    enable_return_routed_experts: bool = False  # keep MoE routing for requests that ask (SGLang's flag)

    def __post_init__(self):
        if self.dtype not in W.DTYPES:
            raise ValueError(f"--dtype must be one of {sorted(W.DTYPES)}, got {self.dtype!r}")
        if self.sglang_api not in API_VERSIONS:
            raise ValueError(f"--sglang-api must be one of {API_VERSIONS}, got {self.sglang_api!r}")

    @property
    def sessions(self) -> bool:
        return self.sglang_api != "0.5.20"


API_VERSIONS = (SGLANG_API_VERSION, "0.5.20")


class _State:
    def __init__(self, args: ServerArgs, model):
        self.args = args
        self.model = model
        self.groups: dict[str, dist.ProcessGroup] = {}
        self.session = False  # between begin_weight_update and end_weight_update
        self.updates = 0  # update_weights_from_distributed calls so far
        self.generates = 0  # generate calls so far
        self.recv_buffer = W.ReusableBuffer()
        self.noise = torch.Generator().manual_seed(args.random_seed)  # --perturb-weights


def _perturb(st: _State, names) -> None:
    """Fault injection (``--perturb-weights``): the loaded weights, silently off."""
    if not st.args.perturb_weights:
        return
    params = dict(st.model.named_parameters())
    for name in names:
        if name in params:
            p = params[name].data
            noise = torch.randn(p.shape, generator=st.noise, dtype=torch.float32).to(p.dtype)
            p.mul_(1 + st.args.perturb_weights * noise)


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"object": "error", "message": message, "type": "BadRequest"
                              if status == 400 else "Error", "code": status}, status=status)


def _result(ok: bool, message: str) -> web.Response:
    return web.json_response({"success": ok, "message": message}, status=200 if ok else 400)


async def _body(request: web.Request) -> dict:
    if not request.can_read_body:
        return {}
    try:
        body = await request.json()
    except ValueError as e:
        raise web.HTTPBadRequest(text=f"request body is not JSON: {e}") from e
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(text="request body must be a JSON object")
    return body


def _api_key_middleware(key: str):
    @web.middleware
    async def check(request: web.Request, handler):
        # SGLang leaves the health probe open so that load balancers can use it; a
        # constant-time comparison as SGLang's (srt/utils/auth.py decide_request_auth).
        if request.path not in ("/health", "/health_generate") and \
                not secrets.compare_digest(request.headers.get("Authorization", "").encode(),
                                           f"Bearer {key}".encode()):
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)
    return check


def _sigstop_middleware(spec: str):
    """Fault injection: ``ROUTE:N`` stops this process (SIGSTOP: a hung engine whose socket
    still accepts) when the N-th request to ROUTE arrives, before it is served."""
    route, n = spec.rsplit(":", 1)
    seen = [0]

    @web.middleware
    async def stop(request: web.Request, handler):
        if request.path == route:
            seen[0] += 1
            if seen[0] == int(n):
                os.kill(os.getpid(), signal.SIGSTOP)
        return await handler(request)
    return stop


def build_app(args: ServerArgs, engine: DecodeEngine, model) -> web.Application:
    middlewares = [_api_key_middleware(args.api_key)] if args.api_key else []
    if args.sigstop_at:
        middlewares.append(_sigstop_middleware(args.sigstop_at))
    app = web.Application(middlewares=middlewares, client_max_size=64 * 2**20)
    app[ENGINE_KEY] = engine
    app[STATE_KEY] = _State(args, model)
    r = app.router
    r.add_get("/health", health)
    r.add_get("/health_generate", health)
    for path in ("/model_info", "/get_model_info"):
        r.add_get(path, model_info)
    r.add_get("/server_info", server_info)
    r.add_get("/get_server_info", server_info)
    r.add_post("/generate", generate)
    r.add_post("/abort_request", abort_request)
    r.add_post("/pause_generation", pause_generation)
    r.add_post("/continue_generation", continue_generation)
    r.add_route("*", "/flush_cache", flush_cache)
    r.add_post("/init_weights_update_group", init_weights_update_group)
    r.add_post("/destroy_weights_update_group", destroy_weights_update_group)
    if args.sessions:
        r.add_post("/begin_weight_update", begin_weight_update)
        r.add_post("/end_weight_update", end_weight_update)
    else:  # 0.5.10-0.5.20 keep the route only to say it is gone
        r.add_get("/get_weight_version", get_weight_version)
    r.add_post("/update_weights_from_distributed", update_weights_from_distributed)
    r.add_post("/update_weights_from_disk", update_weights_from_disk)
    r.add_route("*", "/get_weights_by_name", get_weights_by_name)
    return app


async def health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def model_info(request: web.Request) -> web.Response:
    st, eng = request.app[STATE_KEY], request.app[ENGINE_KEY]
    return web.json_response({"model_path": st.args.model_path, "tokenizer_path": None,
                              "is_generation": True, "preferred_sampling_params": None,
                              "weight_version": eng.weight_version})


async def server_info(request: web.Request) -> web.Response:
    st, eng = request.app[STATE_KEY], request.app[ENGINE_KEY]
    return web.json_response({
        "version": st.args.sglang_api, "engine": "areal-mcore-embedded",
        "model_path": st.args.model_path, "random_seed": st.args.random_seed,
        "dtype": st.args.dtype, "context_length": eng.context_length, "tp_size": 1,
        "dp_size": 1, "pp_size": 1,
        "skip_tokenizer_init": True, "max_running_requests": eng.max_running_requests,
        "weight_version": eng.weight_version,
        "internal_states": [{"num_running_reqs": eng.num_running, "paused": eng.paused,
                             "decode_steps": eng.steps, "generated_tokens": eng.generated_tokens}],
    })


async def get_weight_version(request: web.Request) -> web.Response:
    return web.json_response({"detail": "Endpoint '/get_weight_version' or '/weight_version' is "
                              "deprecated. Please use '/model_info' instead."}, status=404)


def _meta(req: Request, return_logprob: bool, routed_start: int = 0) -> dict:
    meta = {"id": req.rid, "finish_reason": req.finish_reason,
            "prompt_tokens": len(req.input_ids), "completion_tokens": len(req.output_ids),
            "cached_tokens": 0, "weight_version": req.weight_version,
            "weight_versions": req.weight_versions()}
    if return_logprob:
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(req.logprobs, req.output_ids)]
    routed = req.routed_experts()
    if routed is not None:  # SGLang's TokenizerManager: b64encode(tensor.numpy().tobytes())
        meta["routed_experts"] = base64.b64encode(routed[routed_start:].numpy().tobytes()).decode("ascii")
    return meta


async def _run_one(engine: DecodeEngine, rid: str, input_ids, params: SamplingParams,
                   routed: bool = False) -> Request:
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def on_done(req: Request) -> None:  # engine thread -> event loop
        loop.call_soon_threadsafe(lambda: done.done() or done.set_result(req))

    if not (isinstance(input_ids, list) and input_ids
            and all(isinstance(t, int) and not isinstance(t, bool) for t in input_ids)):
        raise ValueError("input_ids must be a non-empty list of token ids (ints)")
    if params.min_new_tokens > 0:  # SGLang's raise_if_tokenizer_required, word for word
        raise ValueError(f"min_new_tokens={params.min_new_tokens} is unavailable when "
                         "skip_tokenizer_init=True (requires tokenizer for eos_token_id).")
    req = Request(rid=rid, input_ids=input_ids, params=params, on_done=on_done, return_routed_experts=routed)
    engine.submit(req)
    try:
        return await done
    except asyncio.CancelledError:  # client went away (or timed out): free the slot
        engine.abort(rid, message="client disconnected")
        raise


async def generate(request: web.Request) -> web.Response:
    body = await _body(request)
    engine = request.app[ENGINE_KEY]
    if body.get("text") is not None:
        return _error(400, "the embedded server runs with skip_tokenizer_init: send input_ids, not text")
    if body.get("stream"):
        return _error(400, "stream=true is not supported by the embedded server")
    ids = body.get("input_ids")
    batched = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
    st = request.app[STATE_KEY]
    st.generates += 1
    if st.args.stall_after and st.generates > st.args.stall_after:  # fault injection
        await asyncio.Event().wait()  # as a stalled engine: the connection stays open, no answer
    # SGLang keeps routing only with --enable-return-routed-experts (its capturer exists
    # only then); without it a request that asks gets none, and no error.
    routed = bool(body.get("return_routed_experts")) and st.args.enable_return_routed_experts
    routed_start = body.get("routed_experts_start_len") or 0
    try:
        sampling = body.get("sampling_params") or {}
        rids = body.get("rid")
        prompts = (ids if batched else [ids]) if isinstance(ids, list) else []
        if routed and (not isinstance(routed_start, int) or not 0 <= routed_start <= min(
                (len(i) for i in prompts if isinstance(i, list)), default=0)):  # SGLang aborts these
            raise ValueError(f"routed_experts_start_len={routed_start!r} must be in [0, input tokens]")
        if batched:
            n = len(ids)
            samplings = sampling if isinstance(sampling, list) else [sampling] * n
            rids = rids if isinstance(rids, list) else [uuid.uuid4().hex for _ in range(n)]
            if len(samplings) != n or len(rids) != n:
                raise ValueError(f"{n} input_ids need {n} sampling_params and {n} rids")
            params = [SamplingParams.from_json(s) for s in samplings]
            reqs = await asyncio.gather(*[_run_one(engine, str(rid), i, p, routed)
                                          for rid, i, p in zip(rids, ids, params)])
        else:
            reqs = [await _run_one(engine, str(rids or uuid.uuid4().hex), ids,
                                   SamplingParams.from_json(sampling), routed)]
    except ValueError as e:
        return _error(400, str(e))
    ret = [{"output_ids": r.output_ids, "meta_info": _meta(r, bool(body.get("return_logprob")), routed_start)}
           for r in reqs]
    return web.json_response(ret if batched else ret[0])


async def abort_request(request: web.Request) -> web.Response:
    body = await _body(request)
    request.app[ENGINE_KEY].abort(body.get("rid"), abort_all=bool(body.get("abort_all")))
    return web.Response(status=200)


async def pause_generation(request: web.Request) -> web.Response:
    body = await _body(request)
    try:
        await asyncio.to_thread(request.app[ENGINE_KEY].pause, body.get("mode", "abort"))
    except ValueError as e:
        return _error(400, str(e))
    return web.json_response({"message": "Generation paused successfully.", "status": "ok"})


async def continue_generation(request: web.Request) -> web.Response:
    request.app[ENGINE_KEY].resume()
    return web.json_response({"message": "Generation continued successfully.", "status": "ok"})


async def flush_cache(request: web.Request) -> web.Response:
    # No prefix (radix) cache is kept here, but the idle rule is SGLang's: a flush while
    # requests run or wait is refused (so with pause mode in_place it always is).
    if request.app[ENGINE_KEY].busy:
        return web.Response(status=400, text="Cache not flushed: there are running or waiting requests.\n")
    return web.Response(status=200, text="Cache flushed.\n")


def join_group(*, master_address: str, master_port: int, rank: int, world_size: int,
               group_name: str, backend: str, timeout_s: float = 600.0) -> dist.ProcessGroup:
    """Joins the trainer's update group the way SGLang's ``init_custom_process_group``
    does: a ``tcp://`` rendezvous, ``PrefixStore(group_name)``, then torch's group helper
    (which prefixes the keys again with the group name and the device)."""
    from torch.distributed import distributed_c10d as c10d

    timeout = datetime.timedelta(seconds=timeout_s)
    init = f"tcp://{master_address}:{master_port}"
    store, rank, world_size = next(c10d.rendezvous(init, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = c10d._new_process_group_helper(
        world_size, rank, [], c10d.Backend(backend), dist.PrefixStore(group_name, store),
        group_name=group_name, backend_options=None, timeout=timeout)
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def _delay(args: ServerArgs, group_name: str) -> float:
    if not args.delay_group_init:
        return 0.0
    substr, _, seconds = args.delay_group_init.partition("=")
    return float(seconds) if substr in group_name else 0.0


async def init_weights_update_group(request: web.Request) -> web.Response:
    body = await _body(request)
    st, engine = request.app[STATE_KEY], request.app[ENGINE_KEY]
    try:
        name = body["group_name"]
        kwargs = dict(master_address=body["master_address"], master_port=int(body["master_port"]),
                      rank=int(body["rank_offset"]), world_size=int(body["world_size"]),
                      group_name=name, backend=body.get("backend", "nccl"))
    except KeyError as e:
        return _result(False, f"init_weights_update_group needs {e.args[0]!r}")
    if st.args.refuse_group_init:  # fault injection: refused at once, as a bad request is
        return _result(False, "Failed to initialize custom process group: injected refusal.")
    # Fault injection: held before it queues, so it reaches the engine after later calls.
    await asyncio.sleep(_delay(st.args, name))

    def join():
        if name in st.groups:  # torch refuses an existing group name too
            raise ValueError(f"The specified group name {name!r} has already been created")
        st.groups[name] = join_group(**kwargs)
        log.info("joined weight-update group %s as rank %d of %d", name, kwargs["rank"],
                 kwargs["world_size"])

    # On the engine thread, as SGLang's scheduler does it: one init at a time, in arrival
    # order, and nothing else (generation included) runs until the group has formed.
    try:
        await asyncio.wrap_future(engine.call(join))
    except (ValueError, RuntimeError) as e:
        return _result(False, f"Failed to initialize custom process group: {e}.")
    return _result(True, "Succeeded to initialize custom process group.")


async def destroy_weights_update_group(request: web.Request) -> web.Response:
    body = await _body(request)
    st, engine = request.app[STATE_KEY], request.app[ENGINE_KEY]
    group = st.groups.pop(body.get("group_name", "weight_update_group"), None)
    if group is None:
        return _result(False, "The group to be destroyed does not exist.")
    await asyncio.wrap_future(engine.call(lambda: dist.destroy_process_group(group)))
    return _result(True, "Succeeded to destroy custom process group.")


async def begin_weight_update(request: web.Request) -> web.Response:
    st = request.app[STATE_KEY]
    if st.session:
        return _result(False, "a weight-update session is already open; call end_weight_update() first")
    st.session = True
    log.info("weight-update session opened")
    return _result(True, "Success")


async def end_weight_update(request: web.Request) -> web.Response:
    st = request.app[STATE_KEY]
    if not st.session:
        return _result(False, "no weight-update session is open; call begin_weight_update() first")
    st.session = False
    log.info("weight-update session closed")
    return _result(True, "Success")


def _check_update(body: dict, st: _State) -> tuple[list, list, list, dist.ProcessGroup]:
    names, dtypes, shapes = body["names"], body["dtypes"], body["shapes"]
    name = body.get("group_name", "weight_update_group")
    if name not in st.groups:
        raise ValueError(f"Group {name} not in {list(st.groups)}. Please call "
                         "`init_weights_update_group` first.")
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(f"{len(names)} names, {len(dtypes)} dtypes, {len(shapes)} shapes")
    bad = sorted({d for d in dtypes if d not in W.DTYPES})
    if bad:
        raise ValueError(f"dtypes {bad} not in {sorted(W.DTYPES)}")
    if body.get("load_format") not in (None, "flattened_bucket"):
        raise ValueError(f"load_format must be null or 'flattened_bucket', got {body['load_format']!r}")
    return names, dtypes, shapes, st.groups[name]


async def update_weights_from_distributed(request: web.Request) -> web.Response:
    body = await _body(request)
    st, engine = request.app[STATE_KEY], request.app[ENGINE_KEY]
    if st.args.sessions and not st.session:
        return _result(False, "update_weights_from_distributed must run between "
                              "begin_weight_update() and end_weight_update()")
    try:
        names, dtypes, shapes, group = _check_update(body, st)
    except KeyError as e:
        return _result(False, f"update_weights_from_distributed: missing field {e.args[0]!r}")
    except ValueError as e:
        return _result(False, f"update_weights_from_distributed: {e}")
    if body.get("abort_all_requests"):
        engine.abort(abort_all=True, message="Aborted for a weight update")
    st.updates += 1
    if st.updates == st.args.die_at_update:
        os.kill(os.getpid(), signal.SIGKILL)
    if st.updates == st.args.refuse_update:  # answered before the receive, as a bad request is
        return _result(False, "update_weights_from_distributed: injected refusal (--refuse-update)")
    inject = st.updates == st.args.fail_update

    def receive_and_load() -> str | None:
        # Like SGLang: receive first (every rank must take part in the broadcast), then
        # check and load; a failed check fails the call after the wire.
        if body.get("load_format") == "flattened_bucket":
            received = W.receive_flat(group, st.recv_buffer, names, dtypes, shapes)
        else:
            received = W.receive_each(group, st.model, names, dtypes, shapes)
        if inject:
            return "Failed to update weights: injected fault (--fail-update)."
        try:
            W.check_weights(st.model, names, shapes)
        except ValueError as e:
            return f"Failed to update weights: {e}."
        W.load_weights(st.model, received)
        _perturb(st, names)
        if body.get("weight_version") is not None:
            engine.set_weight_version(str(body["weight_version"]))
        if body.get("flush_cache", True) and engine.busy:  # SGLang's default is to flush
            return ("Weights were updated, but the cache was not flushed because requests are "
                    "still running or queued. Retract or finish them, then call /flush_cache.")
        return None

    try:
        failure = await asyncio.wrap_future(engine.call(receive_and_load))
    except RuntimeError as e:
        return _result(False, f"Failed to receive weights: {e}")
    if failure:
        return _result(False, failure)
    return _result(True, "Succeeded to update parameter online.")


async def update_weights_from_disk(request: web.Request) -> web.Response:
    body = await _body(request)
    st, engine = request.app[STATE_KEY], request.app[ENGINE_KEY]
    path = body.get("model_path")
    try:
        if not path:
            raise ValueError("model_path is required")
        root = st.args.weights_root
        if root and not within(path, root):
            # Any caller could otherwise make the server serve weights of its choosing.
            return web.json_response({"success": False, "num_paused_requests": 0, "message":
                                      f"model_path {path} is outside this server's weights root {root} "
                                      "(--weights-root): it loads weights from under that folder only"},
                                     status=403)
        state = await asyncio.to_thread(load_hf_state_dict, path)
        W.check_weights(st.model, list(state), [list(t.shape) for t in state.values()])
    except (ValueError, FileNotFoundError, OSError) as e:
        return web.json_response({"success": False, "message": str(e), "num_paused_requests": 0},
                                 status=400)
    if body.get("abort_all_requests"):
        engine.abort(abort_all=True, message="Aborted for a weight update")

    def load():
        W.load_weights(st.model, state.items())
        _perturb(st, list(state))
        if body.get("weight_version") is not None:
            engine.set_weight_version(str(body["weight_version"]))

    await asyncio.wrap_future(engine.call(load))
    return web.json_response({"success": True, "message": f"Loaded {len(state)} tensors from {path}.",
                              "num_paused_requests": 0})


async def get_weights_by_name(request: web.Request) -> web.Response:
    """SGLang's debugging route: the first ``truncate_size`` rows of a parameter."""
    body = await _body(request)
    params = dict(request.app[STATE_KEY].model.named_parameters())
    name = body.get("name")
    if name not in params:
        return _error(400, f"unknown weight {name!r}")
    rows = params[name].detach()[: int(body.get("truncate_size", 100))]
    return web.json_response(rows.float().tolist())


def load_model(args: ServerArgs):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=W.DTYPES[args.dtype],
                                                 attn_implementation="sdpa")
    return model.eval().requires_grad_(False)


def eos_ids(model) -> list[int]:
    ids = []
    for cfg in (getattr(model, "generation_config", None), model.config):
        eos = getattr(cfg, "eos_token_id", None) if cfg is not None else None
        ids += eos if isinstance(eos, list) else ([eos] if eos is not None else [])
    return sorted(set(ids))


async def serve(args: ServerArgs) -> None:
    model = load_model(args)
    context = args.context_length or getattr(model.config, "max_position_embeddings", 32768)
    engine = DecodeEngine(model, eos_token_ids=eos_ids(model), context_length=context,
                          max_running_requests=args.max_running_requests, seed=args.random_seed,
                          weight_version=args.weight_version, step_delay_s=args.step_delay_s,
                          return_routed_experts=args.enable_return_routed_experts)
    runner = web.AppRunner(build_app(args, engine, model), handler_cancellation=True,
                           access_log=None)
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port).start()
    log.info("embedded rollout server on http://%s:%d (%s)", args.host, args.port, args.model_path)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
        engine.close()


def parse_args(argv: list[str] | None = None) -> ServerArgs:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--weights-root", default=None, metavar="DIR",
                   help="update_weights_from_disk loads from under DIR only (default: anywhere)")
    p.add_argument("--random-seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=sorted(W.DTYPES))
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument("--weight-version", default="default")
    p.add_argument("--sglang-api", default=SGLANG_API_VERSION, choices=API_VERSIONS,
                   help="the SGLang HTTP API to serve (0.5.20: no weight-update sessions)")
    p.add_argument("--fail-update", type=int, default=0,
                   help="fault injection: the N-th update_weights_from_distributed fails")
    p.add_argument("--die-at-update", type=int, default=0,
                   help="fault injection: SIGKILL at the N-th update_weights_from_distributed")
    p.add_argument("--stall-after", type=int, default=0,
                   help="fault injection: generate requests after the N-th are never answered")
    p.add_argument("--step-delay-s", type=float, default=0.0,
                   help="fault injection: sleep this long after every decode step (a slow engine)")
    p.add_argument("--sigstop-at", default=None, metavar="ROUTE:N",
                   help="fault injection: SIGSTOP this server when the N-th request to ROUTE arrives")
    p.add_argument("--perturb-weights", type=float, default=0.0, metavar="STD",
                   help="fault injection: every loaded weight times (1 + STD * N(0,1)), reported as a success")
    p.add_argument("--refuse-update", type=int, default=0,
                   help="fault injection: refuse the N-th update_weights_from_distributed "
                        "before its receive")
    p.add_argument("--refuse-group-init", action="store_true",
                   help="fault injection: refuse every init_weights_update_group at once")
    p.add_argument("--delay-group-init", default=None, metavar="SUBSTR=SECONDS",
                   help="fault injection: delay init calls whose group name contains SUBSTR")
    p.add_argument("--enable-return-routed-experts", action="store_true",
                   help="MoE: return the experts each token was routed to when a request asks (SGLang's flag)")
    p.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads")
    ns = p.parse_args(argv)
    if ns.num_threads:
        torch.set_num_threads(ns.num_threads)
    # The key from the environment only: a flag would show it in `ps` to every local user.
    return ServerArgs(api_key=os.environ.get(KEY_ENV) or None,
                      **{k: v for k, v in vars(ns).items() if k != "num_threads"})


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    asyncio.run(serve(parse_args(argv)))


if __name__ == "__main__":
    main()
