"""The embedded server over HTTP: weight updates by broadcast and from disk, flush, pause,
API key, weights root and bind address. One server subprocess for the module (startup ~9 s),
launched as the trainer launches its own."""

from __future__ import annotations

import os
import stat
import threading
import time

import psutil
import pytest
import torch
from _rollout import http, tiny_hf_dir

from areal_mcore.convert.hf_files import load_hf_state_dict
from areal_mcore.net import free_port
from areal_mcore.rollout.auth import KEY_ENV, launch_key
from areal_mcore.rollout.config import ServerConfig
from areal_mcore.rollout.embedded.server import parse_args
from areal_mcore.rollout.servers import launch_servers
from areal_mcore.run_dir import RunDir
from areal_mcore.weight_sync.group import destroy_update_group, init_update_group

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_hf_dir(str(tmp_path_factory.mktemp("hf")), seed=11)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    """As trainer/rollout_side.py launches: no server.api_key, so a key generated for the
    run and kept in it, and disk loads from under the run directory only (here this
    session's temporary root: every test's tmp_path is inside)."""
    run = RunDir(tmp_path_factory.getbasetemp())
    cfg = ServerConfig(model_path=model_dir, dtype="float32", context_length=256, startup_timeout_s=120,
                       log_dir=str(tmp_path_factory.mktemp("logs")))
    key = launch_key(cfg, run)
    (s,) = launch_servers(cfg, env={**os.environ, "OMP_NUM_THREADS": "1"}, api_key=key,
                          weights_root=str(run.path))
    s.api_key, s.run = key, run
    try:
        yield s
    finally:
        s.stop(grace_s=5)


def _call(server, method, path, body=None, **kw):
    return http(server.address, method, path, body, key=server.api_key, **kw)


def _in_thread(fn, *args, **kwargs):
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("out", fn(*args, **kwargs)))
    t.start()
    return t, box


def _generate(server, max_new_tokens=8, **sampling):
    return _call(server, "POST", "/generate", {
        "input_ids": [5, 6, 7, 8], "return_logprob": True,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, **sampling}})


def _state(server):
    return _call(server, "GET", "/server_info")[1]["internal_states"][0]


def _wait_decoding(server):
    """Returns once a request is running and has decoded a few tokens."""
    deadline = time.time() + 30
    while _state(server)["num_running_reqs"] == 0:
        assert time.time() < deadline
    steps = _state(server)["decode_steps"]
    while _state(server)["decode_steps"] < steps + 3:
        assert time.time() < deadline


def _reference_greedy(model_dir, state, prompt, n):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ref.load_state_dict(state, strict=False)
    return ref.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                        eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()


def test_requests_without_the_generated_api_key_are_refused(server):
    key_file = server.run.rollout_key_file
    assert key_file.read_text().strip() == server.api_key and len(server.api_key) >= 32
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    # Any local process: the admin routes (a load of its weights, a group at its address)
    # and generation are refused without the key, or with another one.
    group = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2,
             "group_name": "intruder", "backend": "gloo"}
    for key in (None, "wrong"):
        assert http(server.address, "POST", "/update_weights_from_disk",
                    {"model_path": str(server.run.path), "weight_version": "7"}, key=key)[0] == 401
        assert http(server.address, "POST", "/init_weights_update_group", group, key=key, timeout=10)[0] == 401
        assert http(server.address, "POST", "/generate", {"input_ids": [1, 2]}, key=key)[0] == 401
    assert http(server.address, "GET", "/model_info", key="wrong")[0] == 401
    assert http(server.address, "GET", "/health")[0] == 200  # probes stay open, as in SGLang
    assert _call(server, "GET", "/model_info")[1]["weight_version"] == "default"
    assert _generate(server, max_new_tokens=2)[0] == 200


def test_the_key_is_on_no_command_line(server):
    """``ps`` shows every process's arguments to every user of the node: the key goes by
    the environment (owner-only), and the log, where SGLang writes it, is owner-only."""
    root = psutil.Process(server.proc.pid)
    for proc in [root, *root.children(recursive=True)]:
        assert not any(server.api_key in arg for arg in proc.cmdline()), proc.cmdline()
    assert root.environ()[KEY_ENV] == server.api_key
    assert stat.S_IMODE(os.stat(server.log_path).st_mode) == 0o600


def test_default_bind_is_loopback(server):
    assert parse_args(["--model-path", "x"]).host == "127.0.0.1"
    assert ServerConfig(model_path="x").host == "127.0.0.1"
    proc = psutil.Process(server.proc.pid)
    listening = [c.laddr for c in proc.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN]
    assert listening and all(a.ip == "127.0.0.1" for a in listening)


def test_weight_update_over_gloo_is_bitwise_and_bumps_the_version(server, model_dir):
    state = load_hf_state_dict(model_dir)
    g = torch.Generator().manual_seed(0)
    new = {k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in state.items()}
    port = free_port()
    t, box = _in_thread(_call, server, "POST", "/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
        "group_name": "wu", "backend": "gloo"})
    group = init_update_group(master_address="127.0.0.1", master_port=port, world_size=2,
                              group_name="wu", backend="gloo", timeout_s=60)
    t.join()
    assert box["out"][0] == 200, box

    names = sorted(new)
    body = {"names": names, "dtypes": ["float32"] * len(names),
            "shapes": [list(new[n].shape) for n in names], "group_name": "wu",
            "flush_cache": True, "weight_version": "1"}
    status, out = _call(server, "POST", "/update_weights_from_distributed", body)
    assert status == 400 and "between begin_weight_update() and end_weight_update()" in out["message"]
    assert _call(server, "POST", "/begin_weight_update", {})[0] == 200
    status, out = _call(server, "POST", "/begin_weight_update", {})  # one session at a time
    assert status == 400 and "already open" in out["message"]
    t, box = _in_thread(_call, server, "POST", "/update_weights_from_distributed", body)
    for n in names:
        group.broadcast(new[n].clone(), 0).wait()
    t.join()
    assert box["out"] == (200, {"success": True, "message": "Succeeded to update parameter online."})

    # As in SGLang, a bad name is received (the broadcast must complete on every rank),
    # then refused without loading anything or changing the version.
    t, box = _in_thread(_call, server, "POST", "/update_weights_from_distributed", {
        "names": ["model.nope.weight"], "dtypes": ["float32"], "shapes": [[2]], "group_name": "wu",
        "weight_version": "2"})
    group.broadcast(torch.zeros(2), 0).wait()
    t.join()
    status, out = box["out"]
    assert status == 400 and "unknown weight 'model.nope.weight'" in out["message"]
    assert _call(server, "POST", "/end_weight_update", {})[0] == 200
    assert _call(server, "POST", "/end_weight_update", {})[0] == 400  # no session open

    for n in names:
        status, rows = _call(server, "POST", "/get_weights_by_name",
                             {"name": n, "truncate_size": new[n].shape[0]})
        assert status == 200 and torch.equal(torch.tensor(rows, dtype=torch.float32), new[n]), n
    assert _call(server, "GET", "/model_info")[1]["weight_version"] == "1"
    status, out = _generate(server, 12)
    assert out["meta_info"]["weight_version"] == "1"
    assert out["output_ids"] == _reference_greedy(model_dir, new, [5, 6, 7, 8], 12)
    # Destroyed, the name is free again (torch refuses a name it still holds).
    assert _call(server, "POST", "/destroy_weights_update_group", {"group_name": "wu"})[0] == 200
    assert _call(server, "POST", "/destroy_weights_update_group", {"group_name": "wu"})[0] == 400
    destroy_update_group(group)


def test_min_new_tokens_is_refused_without_a_tokenizer_as_sglang_does(server):
    status, out = _call(server, "POST", "/generate", {
        "input_ids": [5, 6], "sampling_params": {"max_new_tokens": 4, "min_new_tokens": 2}})
    assert status == 400 and "min_new_tokens=2 is unavailable when skip_tokenizer_init=True" \
        in out["message"]


def test_update_weights_from_disk_loads_by_name(server, model_dir, tmp_path):
    from safetensors.torch import save_file

    state = load_hf_state_dict(model_dir)
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    status, out = _call(server, "POST", "/update_weights_from_disk",
                        {"model_path": str(tmp_path), "weight_version": "7"})
    assert status == 200 and out["success"], out
    name = "model.layers.0.mlp.up_proj.weight"
    rows = _call(server, "POST", "/get_weights_by_name", {"name": name, "truncate_size": 1000})[1]
    assert torch.equal(torch.tensor(rows), state[name])
    assert _call(server, "GET", "/model_info")[1]["weight_version"] == "7"
    status, out = _call(server, "POST", "/update_weights_from_disk", {"model_path": str(tmp_path / "no")})
    assert status == 400 and "model.safetensors not found" in out["message"]


def test_update_weights_from_disk_is_refused_outside_the_weights_root(server, model_dir, tmp_path):
    """Even with the key: a loadable folder outside the run directory, directly or through a
    link inside it, is refused naming the root, and nothing is loaded."""
    import shutil
    import tempfile

    outside = tempfile.mkdtemp(prefix="not_the_run_")  # /tmp, beside pytest's root
    try:
        shutil.copytree(model_dir, outside, dirs_exist_ok=True)
        (tmp_path / "link").symlink_to(outside)
        before = _call(server, "GET", "/model_info")[1]["weight_version"]
        for path in (outside, str(tmp_path / "link"), str(server.run.path / ".." / os.path.basename(outside))):
            status, out = _call(server, "POST", "/update_weights_from_disk",
                                {"model_path": path, "weight_version": "intruder"})
            assert status == 403 and not out["success"], (path, out)
            assert f"outside this server's weights root {server.run.path}" in out["message"]
        assert _call(server, "GET", "/model_info")[1]["weight_version"] == before
    finally:
        shutil.rmtree(outside)


def test_flush_cache_is_refused_while_requests_run(server):
    t, box = _in_thread(_generate, server, 200, ignore_eos=True)
    _wait_decoding(server)
    assert _call(server, "POST", "/flush_cache")[0] == 400
    t.join()
    assert box["out"][0] == 200
    assert _call(server, "POST", "/flush_cache")[0] == 200


def test_pause_aborts_running_holds_new_requests_and_continue_resumes(server):
    t, box = _in_thread(_generate, server, 200, ignore_eos=True)
    _wait_decoding(server)
    assert _call(server, "POST", "/pause_generation", {"mode": "abort"})[0] == 200
    t.join(30)
    status, out = box["out"]
    assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(out["output_ids"]) < 200
    held, hbox = _in_thread(_generate, server, 4)
    time.sleep(1.0)
    assert "out" not in hbox  # waits while paused
    assert _call(server, "POST", "/continue_generation")[0] == 200
    held.join(30)
    assert hbox["out"][1]["meta_info"]["finish_reason"]["type"] == "length"


def test_pause_in_place_keeps_the_request_and_its_tokens(server):
    t, box = _in_thread(_generate, server, 60, ignore_eos=True)
    _wait_decoding(server)
    assert _call(server, "POST", "/pause_generation", {"mode": "in_place"})[0] == 200
    steps = _state(server)["decode_steps"]
    time.sleep(0.5)
    assert _state(server)["decode_steps"] == steps
    assert "out" not in box
    _call(server, "POST", "/continue_generation")
    t.join(30)
    assert box["out"][1]["meta_info"]["finish_reason"] == {"type": "length", "length": 60}
    assert _call(server, "POST", "/pause_generation", {"mode": "sideways"})[0] == 400


def test_64_concurrent_requests_share_decode_steps(server):
    """Requests that arrive together are batched: 64 x 32 tokens take a few dozen forward
    passes, not 64 x 32 (bench/rollout_server.py measures the speed-up)."""
    from concurrent.futures import ThreadPoolExecutor

    before = _state(server)["decode_steps"]
    with ThreadPoolExecutor(64) as pool:
        outs = list(pool.map(lambda i: _call(server, "POST", "/generate", {
            "input_ids": [9, 10 + i % 50, 11], "sampling_params": {
                "max_new_tokens": 32, "ignore_eos": True, "sampling_seed": i}}), range(64)))
    assert all(s == 200 and len(o["output_ids"]) == 32 for s, o in outs)
    steps = _state(server)["decode_steps"] - before
    assert steps < 64 * 32 / 8, steps
