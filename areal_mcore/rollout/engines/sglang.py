"""SGLang's HTTP protocol (0.5.10-0.5.23), spoken by SGLang and by the embedded server.

Generation: ``POST /generate`` with token ids and ``return_logprob``; per-token versions
from ``meta_info.weight_versions`` spans where the server reports them. Weight updates:
``init_weights_update_group`` per stage, ``begin_weight_update`` (0.5.23; 0.5.20 has no
sessions) -> ``update_weights_from_distributed`` per bucket -> ``flush_cache`` ->
``end_weight_update`` -> ``continue_generation``; versions from ``/model_info``.
"""

from __future__ import annotations

import asyncio
import sys
from typing import TYPE_CHECKING

from areal_mcore.rollout.engines.base import (
    Chunk,
    Engine,
    GroupSpec,
    WeightUpdater,
    answer_field,
    answer_object,
    decode_int32_b64,
    describe,
    positive_int,
)
from areal_mcore.rollout.protocol import RolloutError, SamplingParams, parse_version

if TYPE_CHECKING:
    from areal_mcore.rollout.config import ServerConfig
    from areal_mcore.rollout.fleet import Fleet, Server


class SGLangUpdater(WeightUpdater):
    def check_distributed(self, pp_size: int) -> None:
        """SGLang's ``update_weights_from_distributed`` asserts ``dp_size == 1`` and joins
        TP rank r as ``rank_offset + r``: PP stages would take the same ranks."""
        bad = [s for s in self.fleet.servers if s.dp_size != 1 or s.pp_size != 1]
        if bad:
            raise RolloutError(
                "SGLang cannot receive update_weights_from_distributed on servers with "
                "dp_size or pp_size > 1: "
                f"{', '.join(f'{s.address} (dp_size={s.dp_size}, pp_size={s.pp_size})' for s in bad)}"
                "; launch one server per data-parallel replica (rollout.server.n_servers) with "
                "tp_size only, or use weight_sync.mode=disk", [s.address for s in bad])

    async def init_group(self, spec: GroupSpec) -> None:
        f = self.fleet
        await f.each(f.servers, [f.request(s, "POST", "/init_weights_update_group", {
            "master_address": spec.master_address, "master_port": spec.master_port,
            "rank_offset": o, "world_size": spec.world_size, "group_name": spec.group_name,
            "backend": spec.backend}, timeout=600)
            for s, o in zip(f.servers, spec.rank_offsets, strict=True)])

    async def destroy_group(self, spec: GroupSpec) -> None:
        await self.fleet.all("POST", "/destroy_weights_update_group", {"group_name": spec.group_name})

    async def begin(self, pause_mode: str) -> None:
        await self.engine.pause(self.fleet, pause_mode)
        await self.fleet.all("POST", "/begin_weight_update", {}, servers=self._sessions())

    def _sessions(self) -> list[Server]:
        """The servers with update sessions (0.5.20 and older have none)."""
        return [s for s in self.fleet.servers if not s.old_api]

    async def receive_bucket(self, *, names: list[str], dtypes: list[str],
                             shapes: list[list[int]], group: GroupSpec, flatten: bool,
                             weight_version: str | None) -> None:
        """``load_format="flattened_bucket"``: one broadcast of the tensors back to back.
        The new version rides on the last bucket, so a server that did not get everything
        still reports the old one. ``fail_fast``: a refusal means the broadcast cannot
        complete, and the other servers answer only after it (syncer ``_answers``).
        Every member of the group, stalled or not: the broadcast waits for each."""
        await self.fleet.all("POST", "/update_weights_from_distributed", {
            "names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group.group_name,
            "flush_cache": False, "weight_version": weight_version,
            "load_format": "flattened_bucket" if flatten else None},
            servers=self.fleet.servers, fail_fast=True)

    async def finish(self, pause_mode: str, version: str) -> None:
        # SGLang refuses /flush_cache while requests keep their cache (pause mode in_place).
        if pause_mode != "in_place":
            await self.engine.flush_cache(self.fleet)
        await self.end(best_effort=False)
        await self.engine.resume(self.fleet)

    async def end(self, *, best_effort: bool) -> None:
        if not best_effort:
            await self.fleet.all("POST", "/end_weight_update", {}, servers=self._sessions())
            return
        await asyncio.gather(*[self.fleet.request(s, "POST", "/end_weight_update", {}, timeout=60)
                               for s in self._sessions()], return_exceptions=True)

    async def from_disk(self, path: str, version: str, pause_mode: str) -> None:
        await self.engine.pause(self.fleet, pause_mode)
        await self.fleet.all("POST", "/update_weights_from_disk",
                             {"model_path": path, "weight_version": version})
        await self.engine.resume(self.fleet)


class SGLangEngine(Engine):
    name = "sglang"
    updater_class = SGLangUpdater

    def command(self, cfg: ServerConfig, *, port: int, seed: int) -> list[str]:
        cmd = [cfg.python or sys.executable, "-m", "sglang.launch_server",
               "--model-path", cfg.model_path, "--tp-size", str(cfg.tp_size),
               "--mem-fraction-static", str(cfg.mem_fraction_static),
               "--context-length", str(cfg.context_length), "--random-seed", str(seed),
               "--dtype", cfg.dtype, "--host", cfg.host, "--port", str(port),
               "--max-running-requests", str(cfg.max_running_requests)]
        if cfg.skip_tokenizer_init:
            cmd.append("--skip-tokenizer-init")
        if cfg.return_routed_experts:
            cmd.append("--enable-return-routed-experts")
        return cmd + list(cfg.extra_args)

    def auth(self, cfg: ServerConfig, env: dict[str, str], *, api_key: str | None,
             weights_root: str | None, private_dir: str) -> tuple[list[str], dict[str, str]]:
        """SGLang (0.5.20, 0.5.23) reads its key from its arguments only: ``--api-key``
        (``ServerArgs.api_key``, srt/arg_groups/fields/serving.py; no environment variable
        sets it). The one way around the command line is ``--config FILE.yaml``:
        ``prepare_server_args`` (srt/server_args.py) merges the file's keys into the parsed
        arguments in-process (srt/utils/server_args_config_parser.py
        ``ConfigArgumentMerger.merge_config_with_args``), so ``ps`` shows the file's path,
        and the file is 0600. SGLang itself still logs the key with its server args at
        start-up (entrypoints/engine.py ``_server_args_for_logging``; launch_servers keeps
        the logs 0600) and returns it from ``/server_info`` (behind the key).

        The key guards every route but ``/health*``, ``/ready*`` and ``/metrics``
        (srt/utils/auth.py ``decide_request_auth``), in single-tokenizer mode only
        (entrypoints/http_server.py ``launch_server``: ``add_api_key_middleware``), so a
        key with ``--tokenizer-worker-num`` > 1 is refused here. ``weights_root``: SGLang has
        no such check; ``update_weights_from_disk`` loads any path a caller with the key
        names."""
        if not api_key:
            return [], env
        import json
        from pathlib import Path

        from areal_mcore.checks import field_error
        from areal_mcore.run_dir import write_private

        extra = list(cfg.extra_args)
        workers = "1"  # the last spelling wins, as with argparse
        for flag, value in zip(extra, [*extra[1:], None]):
            if flag == "--tokenizer-worker-num" and value is not None:
                workers = value
            elif flag.startswith("--tokenizer-worker-num="):
                workers = flag.split("=", 1)[1]
        if "--config" in extra:  # SGLang takes one ("Multiple config files specified!")
            raise field_error("server.extra_args", cfg.extra_args,
                              "has --config, but the launcher passes the server's API key in SGLang's "
                              "--config file (never on the command line): put the options of your file "
                              "in server.extra_args instead")
        if api_key.startswith("-"):  # the merge yields "--api-key -..." and argparse fails on it
            raise field_error("server.api_key", "<hidden>", "starts with '-', which SGLang's argument parser "
                              "takes for an option: choose a key (or $AREAL_ROLLOUT_API_KEY) that does not")
        if workers.strip() != "1":
            raise field_error("server.extra_args", cfg.extra_args,
                              f"sets --tokenizer-worker-num {workers}: SGLang checks the API key only with "
                              "one tokenizer worker (its launch_server), and every route would be open")
        path = Path(private_dir) / "sglang_api_key.yaml"
        write_private(path, f"api-key: {json.dumps(api_key)}\n")  # a JSON string is a YAML string
        return ["--config", str(path)], env

    async def detect(self, fleet: Fleet, s: Server) -> None:
        """Version and parallel sizes from /server_info (SGLang 0.5.10-0.5.23 all serve it;
        /get_server_info is its deprecated alias)."""
        errors = []
        for path in ("/server_info", "/get_server_info"):
            try:
                info = answer_object(s, path, await fleet.request(s, "GET", path, timeout=30))
            except RolloutError as e:
                errors.append(str(e))
                continue
            s.version = parse_version(str(info.get("version", "")))
            s.tp_size, s.dp_size, s.pp_size = (answer_field(s, path, info, k, positive_int) if info.get(k) else 1
                                               for k in ("tp_size", "dp_size", "pp_size"))
            return
        raise RolloutError(f"{s.address}: neither /server_info nor /get_server_info answered: "
                           f"{'; '.join(errors)}", [s.address])

    def generate_request(self, s: Server, input_ids: list[int], params: SamplingParams,
                         wire_rid: str, *, routed_experts: bool = False) -> tuple[str, dict]:
        body = {"input_ids": input_ids, "sampling_params": params.to_json(),
                "return_logprob": True, "rid": wire_rid}
        if routed_experts:  # GenerateReqInput.return_routed_experts (SGLang 0.5.20, 0.5.23)
            body["return_routed_experts"] = True
        return "/generate", body

    def parse_generate(self, s: Server, out: dict, requested: int) -> Chunk:
        """SGLang's answer (0.5.10-0.5.23, ``TokenizerManager._handle_batch_output``):
        ``{"output_ids": [...], "meta_info": {"finish_reason": {...}, "weight_version": ...,
        "output_token_logprobs": [[logprob, token_id, text], ...], ...}}``, the triples
        there because every request asks for them (``return_logprob``). SGLang writes its
        answers with orjson (``utils/json_response.py``), which turns a non-finite float
        into ``null``: a null logprob is a NaN as far as we can tell, and refused."""
        meta, ids = out.get("meta_info"), out.get("output_ids")
        if not isinstance(meta, dict):
            raise ValueError(f"meta_info is {'missing' if meta is None else type(meta).__name__}, not an object")
        if not isinstance(ids, list):
            raise ValueError(f"output_ids is {'missing' if ids is None else type(ids).__name__}, not a list")
        triples = meta.get("output_token_logprobs")
        if not isinstance(triples, list) or len(triples) != len(ids):
            raise ValueError(f"{len(ids)} output_ids but meta_info.output_token_logprobs is "
                             f"{'missing' if triples is None else describe(triples)}")
        try:
            logprobs = [lp for lp, _, _ in triples]
            token_ids = [t for _, t, _ in triples]
        except (TypeError, ValueError):
            raise ValueError("meta_info.output_token_logprobs holds entries that are not "
                             "[logprob, token_id, text] triples") from None
        if token_ids != ids:
            i = next(i for i, (a, b) in enumerate(zip(token_ids, ids)) if a != b)
            raise ValueError(f"output token {i} is {ids[i]!r} in output_ids but {token_ids[i]!r} "
                             "in meta_info.output_token_logprobs")
        # A null logprob: Chunk.check refuses it with the other non-numbers (no pass here).
        if meta.get("weight_version") is None and not meta.get("weight_versions"):
            raise ValueError("meta_info has neither weight_version nor weight_versions")
        routed = meta.get("routed_experts")
        return Chunk(output_ids=ids, logprobs=logprobs, versions=token_versions(meta, len(ids)),
                     finish_reason=meta.get("finish_reason"),
                     routed_experts=decode_int32_b64(routed) if routed else None)

    # ---- control -----------------------------------------------------------------------
    async def abort(self, fleet: Fleet, s: Server, wire_rid: str) -> None:
        await fleet.all("POST", "/abort_request", {"rid": wire_rid}, servers=[s])

    async def abort_all(self, fleet: Fleet) -> None:
        await fleet.all("POST", "/abort_request", {"abort_all": True})

    async def pause(self, fleet: Fleet, mode: str) -> None:
        await fleet.all("POST", "/pause_generation", {"mode": mode})

    async def resume(self, fleet: Fleet) -> None:
        await fleet.all("POST", "/continue_generation", {})

    async def flush_cache(self, fleet: Fleet) -> None:
        await fleet.all("POST", "/flush_cache")

    async def weight_versions(self, fleet: Fleet) -> list[str]:
        """Every server's version, from /model_info (on every SGLang version)."""
        servers = fleet.reachable()
        infos = await fleet.all("GET", "/model_info", servers=servers, timeout=30)
        return [answer_field(s, "/model_info", info, "weight_version") for s, info in zip(servers, infos)]


class EmbeddedEngine(SGLangEngine):
    """Our CPU server (``rollout/embedded/server.py``): SGLang's protocol, its own launch command."""

    name = "embedded"

    def command(self, cfg: ServerConfig, *, port: int, seed: int) -> list[str]:
        cmd = [cfg.python or sys.executable, "-m", "areal_mcore.rollout.embedded.server",
               "--model-path", cfg.model_path, "--context-length", str(cfg.context_length),
               "--random-seed", str(seed), "--dtype", cfg.dtype, "--host", cfg.host,
               "--port", str(port), "--max-running-requests", str(cfg.max_running_requests)]
        if cfg.return_routed_experts:
            cmd.append("--enable-return-routed-experts")
        return cmd + list(cfg.extra_args)

    def auth(self, cfg: ServerConfig, env: dict[str, str], *, api_key: str | None,
             weights_root: str | None, private_dir: str) -> tuple[list[str], dict[str, str]]:
        """Our server reads the key from ``$AREAL_ROLLOUT_API_KEY`` (embedded/server.py
        ``parse_args``) and refuses a disk load outside ``--weights-root`` (a path, no secret)."""
        from areal_mcore.rollout.auth import KEY_ENV

        return (["--weights-root", weights_root] if weights_root else [],
                {**env, KEY_ENV: api_key} if api_key else env)


def token_versions(meta: dict, n: int) -> list[str]:
    """The weight version of each of a response's ``n`` output tokens: SGLang's
    ``weight_versions`` spans when present, else the response's ``weight_version``."""
    spans = meta.get("weight_versions")
    if not spans:
        return [str(meta.get("weight_version"))] * n
    out: list[str] = []
    for span in spans:
        out += [str(span["version"])] * (min(span["end"], n) - span["start"])
    return out + [str(spans[-1]["version"])] * (n - len(out))
