"""The vLLM engine's request/response translation, without a server (fast)."""

from __future__ import annotations

import pytest

from areal_mcore.config import load_config
from areal_mcore.rollout.config import ServerConfig
from areal_mcore.rollout.engines.options import VLLMOptions
from areal_mcore.rollout.engines.vllm import VLLMEngine, span_versions, vllm_pause_mode
from areal_mcore.rollout.protocol import SamplingParams
from areal_mcore.rollout.servers import server_command


def test_generate_request_carries_the_samples_seed():
    path, body = VLLMEngine().generate_request(None, [1, 2], SamplingParams(
        sampling_seed=123, top_k=-1, stop_token_ids=[7]), "r.0")
    assert path == "/inference/v1/generate" and body["request_id"] == "r.0"
    assert body["sampling_params"]["seed"] == 123 and body["sampling_params"]["top_k"] == 0
    assert body["sampling_params"]["stop_token_ids"] == [7]
    _, body = VLLMEngine().generate_request(None, [1], SamplingParams(), "r.1")
    assert "seed" not in body["sampling_params"]


@pytest.mark.parametrize("choice, want", [
    ({"finish_reason": "length"}, {"type": "length", "length": 2}),
    ({"finish_reason": "stop", "stop_reason": None}, {"type": "stop", "matched": 6}),
    ({"finish_reason": "stop", "stop_reason": 9}, {"type": "stop", "matched": 9}),
    ({"finish_reason": "abort"}, {"type": "abort", "message": "vLLM finish_reason 'abort'"}),
])
def test_finish_reasons_map_to_ours(choice, want):
    out = {"choices": [{"token_ids": [5, 6], "logprobs": {"content": [
        {"token_id": 5, "logprob": -1.0}, {"token_id": 6, "logprob": -2.0}]}, **choice}]}
    chunk = VLLMEngine().parse_generate(None, out, 4)
    assert chunk.finish_reason == want and chunk.logprobs == [-1.0, -2.0]


def test_weight_version_spans_tag_each_token():
    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}]
    assert span_versions(spans, 5) == ["3", "3", "4", "4", "4"]


def test_pause_modes_map_and_retract_is_refused_at_config_load():
    assert vllm_pause_mode("abort") == "abort" and vllm_pause_mode("in_place") == "keep"
    with pytest.raises(ValueError, match="no vLLM equivalent"):
        load_config("configs/tiny_cpu.yaml", ["server.backend=vllm", "weight_sync.pause_mode=retract"])


def test_launch_command_turns_on_what_the_rl_path_needs():
    cfg = ServerConfig(model_path="/m", backend="vllm", python="/py",
                       vllm=VLLMOptions(weight_transfer_backend="areal_gloo", kv_cache_memory_mb=64))
    cmd = server_command(cfg, port=5, seed=3)
    assert cmd[:3] == ["/py", "-m", "vllm.entrypoints.openai.api_server"]
    for flag in ("--enable-scale-out", "--skip-tokenizer-init"):
        assert flag in cmd
    assert cmd[cmd.index("--logprobs-mode") + 1] == "processed_logprobs"
    assert cmd[cmd.index("--weight-transfer-config") + 1] == '{"backend": "areal_gloo"}'
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and cmd[cmd.index("--seed") + 1] == "3"
    assert VLLMEngine().env(cfg, {})["VLLM_SERVER_DEV_MODE"] == "1"
    assert cmd[cmd.index("--kv-cache-memory-bytes") + 1] == str(64 * 2**20)
    # on CPU: no chunked prefill (seeded requests would crash it), a step budget >= a context
    assert "--no-enable-chunked-prefill" in cmd and cmd[cmd.index("--max-num-batched-tokens") + 1] == "32768"


def test_on_cpu_the_kv_cache_is_sized_from_the_run_not_the_host(tmp_path, monkeypatch):
    import dataclasses
    import json

    import areal_mcore.rollout.engines.vllm as vllm

    (tmp_path / "config.json").write_text(json.dumps({
        "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 128, "num_hidden_layers": 4}))
    cfg = ServerConfig(model_path=str(tmp_path), backend="vllm", python="/py", dtype="float32",
                       context_length=1024, max_running_requests=64)
    cmd = server_command(cfg, port=5, seed=3)
    # 64 sequences x 1024 tokens x (K and V x 4 layers x 2 KV heads x head_dim 32 x 4 bytes)
    assert cmd[cmd.index("--kv-cache-memory-bytes") + 1] == str(64 * 1024 * 2 * 4 * 2 * 32 * 4)
    assert "--gpu-memory-utilization" not in cmd
    small = server_command(ServerConfig(model_path=str(tmp_path), backend="vllm", python="/py",
                                        dtype="bfloat16", context_length=64), port=5, seed=3)
    assert small[small.index("--kv-cache-memory-bytes") + 1] == str(vllm.KV_FLOOR_MB * 2**20)
    with pytest.raises(ValueError, match=r"config.json .*set server.vllm.kv_cache_memory_mb"):
        server_command(ServerConfig(model_path=str(tmp_path / "hub/id"), backend="vllm", python="/py"),
                       port=5, seed=3)
    assert small[small.index("--max-num-batched-tokens") + 1] == "2048"
    long = server_command(dataclasses.replace(cfg, context_length=4096), port=5, seed=3)
    assert long[long.index("--max-num-batched-tokens") + 1] == "4096"
    monkeypatch.setattr(vllm, "_on_cpu", lambda: False)  # a GPU server: SGLang-style fraction
    cmd = server_command(cfg, port=5, seed=3)
    assert cmd[cmd.index("--gpu-memory-utilization") + 1] == "0.9"
    assert "--no-enable-chunked-prefill" not in cmd and "--max-num-batched-tokens" not in cmd


_CHECK = """
import json, os, sys
from fastapi import FastAPI
from fastapi.testclient import TestClient
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.entrypoints.serve.middleware.register import init_entrypoints_middleware
from vllm.utils.argparse_utils import FlexibleArgumentParser
a = make_arg_parser(FlexibleArgumentParser()).parse_args(json.loads(sys.argv[1]))
flags = [a.logprobs_mode, a.enable_chunked_prefill, a.enforce_eager, a.disable_custom_all_reduce,
         a.disable_sliding_window, a.api_key]
PATHS = ["/init_weight_transfer_engine", "/update_weights", "/collective_rpc", "/inference/v1/generate"]
def codes(middleware):  # vLLM's own middleware set-up of the app, on routes at these paths
    app = FastAPI()
    for path in PATHS:
        app.add_api_route(path, lambda: {}, methods=["POST"])
    app.add_api_route("/health", lambda: {}, methods=["GET"])
    init_entrypoints_middleware(argparse_copy(middleware), app, ())
    client = TestClient(app)
    return [[client.post(p, headers=h).status_code for p in PATHS] + [client.get("/health").status_code]
            for h in ({}, {"Authorization": "Bearer " + os.environ["VLLM_API_KEY"]})]
def argparse_copy(middleware):
    import copy
    b = copy.copy(a)
    b.middleware = middleware
    return b
print(json.dumps({"flags": flags, "vllm alone": codes([]), "with our guard": codes(a.middleware)}))
"""


@pytest.mark.venv
def test_every_flag_we_pass_vllm_is_accepted_by_vllms_own_parser(tmp_path):
    """The launch flags and boba's eval flags, parsed by vLLM 0.32's CLI parser (in the
    vLLM venv; the same check `vllm serve` runs before it starts). With a key, vLLM's
    middleware set-up (``init_entrypoints_middleware``) on what our launcher gives: vLLM's
    own check guards ``/inference`` but not the RL and dev routes (``GUARDED_PREFIX``);
    with our ``--middleware`` guard every route but /health needs the key."""
    import json
    import os
    import subprocess

    from _vllm import require_vllm

    from areal_mcore.eval.config import EVAL_VLLM_ARGS, eval_server_config

    cfg = eval_server_config(ServerConfig(model_path=str(tmp_path), backend="vllm",
                                          vllm=VLLMOptions(kv_cache_memory_mb=64, enforce_eager=True)))
    assert list(cfg.extra_args[:len(EVAL_VLLM_ARGS)]) == list(EVAL_VLLM_ARGS)
    extra, env = VLLMEngine().auth(cfg, dict(os.environ), api_key="k3y", weights_root=None,
                                   private_dir=str(tmp_path))
    argv = server_command(cfg, port=5, seed=3)[3:] + extra
    out = subprocess.run([require_vllm(), "-c", _CHECK, json.dumps(argv)], capture_output=True,
                         text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {
        "flags": ["processed_logprobs", False, True, True, True, None],  # no key on the command line
        "vllm alone": [[200, 200, 200, 401, 200], [200] * 5],
        "with our guard": [[401, 401, 401, 401, 200], [200] * 5]}

