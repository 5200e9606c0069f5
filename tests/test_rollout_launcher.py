"""Server command lines and start-up failures."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from areal_mcore.rollout.config import ServerConfig
from areal_mcore.rollout.servers import launch_servers, server_command


def _flag(cmd, name):
    return cmd[cmd.index(name) + 1]


def test_sglang_command_carries_the_config_and_a_seed_per_server():
    cfg = ServerConfig(model_path="/m", backend="sglang", n_servers=2, tp_size=4, seed=10,
                       mem_fraction_static=0.85, context_length=32768, dtype="bfloat16",
                       api_key="k", extra_args=["--log-level", "warning"])
    cmds = [server_command(cfg, port=30000 + i, seed=cfg.seed + i) for i in range(2)]
    assert cmds[0][1:3] == ["-m", "sglang.launch_server"]
    for flag, want in [("--model-path", "/m"), ("--tp-size", "4"), ("--mem-fraction-static", "0.85"),
                       ("--context-length", "32768"), ("--dtype", "bfloat16"), ("--host", "127.0.0.1")]:
        assert _flag(cmds[0], flag) == want
    assert "--api-key" not in cmds[0] and "k" not in cmds[0]  # ps shows it: Engine.auth hands it on
    assert "--skip-tokenizer-init" in cmds[0] and cmds[0][-2:] == ["--log-level", "warning"]
    assert [_flag(c, "--random-seed") for c in cmds] == ["10", "11"]
    assert [_flag(c, "--port") for c in cmds] == ["30000", "30001"]


def test_embedded_command_runs_our_server_module():
    cmd = server_command(ServerConfig(model_path="/m"), port=5, seed=3)
    assert cmd[1:3] == ["-m", "areal_mcore.rollout.embedded.server"] and _flag(cmd, "--random-seed") == "3"


@pytest.mark.parametrize("kw, msg", [({"backend": "trtllm"}, "backend='trtllm' is not allowed"),
                                     ({"backend": "embedded", "tp_size": 2}, "tp_size=2 must be 1"),
                                     ({"mem_fraction_static": 1.5}, "mem_fraction_static")])
def test_bad_server_config_names_the_key(kw, msg):
    with pytest.raises(ValueError, match=msg):
        ServerConfig(model_path="/m", **kw)


@pytest.mark.server
def test_a_server_that_dies_at_start_reports_its_log(tmp_path):
    cfg = ServerConfig(model_path=str(tmp_path / "missing"), log_dir=str(tmp_path / "logs"),
                       startup_timeout_s=60)
    with pytest.raises(RuntimeError, match=r"exited with code .* before it was healthy.*server0.log"):
        launch_servers(cfg)


def test_rollout_imports_no_megatron_and_no_actor():
    """docs/layout.md's layering rules: the inference side starts without the training stack."""
    import subprocess
    import sys

    code = ("import sys, areal_mcore.rollout.embedded.server, areal_mcore.rollout.executor, "
            "areal_mcore.rollout.servers; print(sorted(m for m in sys.modules if "
            "m.startswith(('megatron', 'areal_mcore.actor', 'areal_mcore.trainer'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_server_dies_with_the_process_that_launched_it(tmp_path):
    """A trainer killed with SIGKILL (OOM killer, node agent) leaves no server running,
    although servers live in their own session."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil

    code = ("import sys, time\n"
            "from areal_mcore.rollout.servers import ServerProcess\n"
            f"s = ServerProcess(['sleep', '120'], host='127.0.0.1', port=1, log_path={str(tmp_path / 'log')!r})\n"
            "print(s.proc.pid, flush=True)\n"
            "time.sleep(120)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    server = psutil.Process(int(parent.stdout.readline()))
    assert server.is_running() and os.getsid(server.pid) != os.getsid(parent.pid)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.time() + 10
    while server.is_running() and server.status() != psutil.STATUS_ZOMBIE:
        assert time.time() < deadline, "the server outlived its launcher"
        time.sleep(0.05)


_HEALTH_SERVER = """
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


@pytest.mark.server
def test_a_server_whose_port_was_taken_before_it_bound_is_started_on_another(tmp_path, monkeypatch):
    """The launcher picks a port, the server binds it seconds later: a port taken meanwhile
    ends that server with errno 98, and the launcher starts it again on a new port."""
    import os
    import socket
    import sys

    import areal_mcore.rollout.servers as launcher

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = iter([taken.getsockname()[1]])
    real_free_port = launcher.free_port
    monkeypatch.setattr(launcher, "free_port", lambda host: next(ports, None) or real_free_port(host))
    monkeypatch.setattr(launcher, "server_command",
                        lambda cfg, *, port, seed: [sys.executable, "-c", _HEALTH_SERVER, str(port)])
    cfg = ServerConfig(model_path="/m", log_dir=str(tmp_path), startup_timeout_s=60)
    try:
        (server,) = launch_servers(cfg)
        assert server.port != taken.getsockname()[1] and server.proc.poll() is None
        assert "address already in use" in (tmp_path / "server0.log").read_text().lower()
        server.stop()
    finally:
        taken.close()
    # A fixed base_port is the user's choice: no other port is tried, and the launch is
    # refused naming the port's holder (checked before the start, and after it: the race).
    from areal_mcore.checks import FieldError

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cfg = ServerConfig(model_path="/m", log_dir=str(tmp_path / "fixed"), startup_timeout_s=60, base_port=port)
        expected = rf"server.base_port={port} cannot be used: port {port} is taken by pid {os.getpid()} "
        with pytest.raises(FieldError, match=expected):
            launch_servers(cfg)
        monkeypatch.setattr(launcher, "check_ports_free", lambda cfg: None)
        with pytest.raises(FieldError, match=expected):
            launch_servers(cfg)


def test_free_ports_come_from_below_the_ephemeral_range():
    from areal_mcore.net import _ephemeral_start, free_port

    assert all(10_000 <= free_port() < _ephemeral_start() for _ in range(20))


def test_servers_launched_without_slurm_get_their_own_gpus_after_the_trainers():
    """Outside Slurm every server inherited the trainer's environment and started on GPU 0,
    beside trainer rank 0."""
    from areal_mcore.rollout.servers import server_gpus

    cfg = ServerConfig(model_path="/m", backend="sglang", n_servers=2, tp_size=2)
    assert server_gpus(cfg, gpu_count=8, trainer_gpus=4) == ["4,5", "6,7"]
    assert server_gpus(cfg, gpu_count=8, trainer_gpus=1, visible="3,4,5,6,7,0,1,2") == ["4,5", "6,7"]
    explicit = ServerConfig(model_path="/m", backend="sglang", n_servers=2, tp_size=2, gpus=[7, 6, 1, 2])
    assert server_gpus(explicit, gpu_count=8, trainer_gpus=1) == ["7,6", "1,2"]
    assert server_gpus(ServerConfig(model_path="/m"), gpu_count=0, trainer_gpus=1) == [None]  # CPU
    with pytest.raises(ValueError, match=r"need 4 GPUs besides the trainer's 6; this node has 8: list the servers' "
                                         r"GPUs \(server.gpus\)"):
        server_gpus(cfg, gpu_count=8, trainer_gpus=6)
    with pytest.raises(ValueError, match="must list n_servers x tp_size = 4 GPU indices"):
        ServerConfig(model_path="/m", backend="sglang", n_servers=2, tp_size=2, gpus=[1, 2])


def test_every_launch_path_sets_the_weight_update_groups_nccl_environment(tmp_path, monkeypatch):
    """SGLang sets NCCL_CUMEM_ENABLE=0 and NCCL_NVLS_ENABLE=0 in its own process; the
    trainer and vLLM servers must match (the Slurm launcher exported only the first)."""
    import os

    import areal_mcore.rollout.servers as launcher
    from areal_mcore.net import NCCL_ENV, set_nccl_env

    assert NCCL_ENV == {"NCCL_CUMEM_ENABLE": "0", "NCCL_NVLS_ENABLE": "0"}
    env = {"NCCL_NVLS_ENABLE": "1"}
    set_nccl_env(env)
    assert env == {"NCCL_NVLS_ENABLE": "1", "NCCL_CUMEM_ENABLE": "0"}  # what a user set stays
    for key in NCCL_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(launcher, "server_command", lambda cfg, *, port, seed: ["true"])
    seen = {}
    monkeypatch.setattr(launcher, "ServerProcess", lambda cmd, **kw: seen.update(kw["env"]) or _Up())
    monkeypatch.setattr(launcher, "_gpu_count", lambda: 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    launcher.launch_servers(ServerConfig(model_path="/m", backend="sglang", n_servers=1, tp_size=2,
                                         log_dir=str(tmp_path)))
    assert seen["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert {k: seen[k] for k in NCCL_ENV} == NCCL_ENV and "NCCL_CUMEM_ENABLE" not in os.environ
    # The trainer's side: set before its process group forms.
    import torch.distributed as dist

    from areal_mcore import cli

    at_init = {}
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **kw: at_init.update(os.environ))
    monkeypatch.delenv("RANK", raising=False)
    cli._init_distributed()
    assert {k: at_init[k] for k in NCCL_ENV} == NCCL_ENV


class _Up:
    def wait_healthy(self, timeout_s):
        pass

    def stop(self, grace_s=0):
        pass


def test_health_probes_go_direct_whatever_http_proxy_the_job_environment_sets(monkeypatch):
    """Clusters set http_proxy on compute nodes; a probe through it never reaches the
    server on the next node (here: a proxy address nothing listens on)."""
    from areal_mcore.net import free_port, healthy

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        for var in ("no_proxy", "NO_PROXY"):
            monkeypatch.delenv(var, raising=False)
        for var in ("http_proxy", "HTTP_PROXY"):
            monkeypatch.setenv(var, f"http://127.0.0.1:{free_port()}")
        assert healthy(f"127.0.0.1:{server.server_port}")
        assert not healthy(f"127.0.0.1:{free_port()}")
    finally:
        server.shutdown()


# What torchrun 2.13 hands rank 0 of `torchrun --nproc-per-node 2` (local_elastic_agent.py::
# _start_workers, multiprocessing/api.py::DefaultLogsSpecs.reify).
_TORCHRUN_ENV = {
    "RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0", "ROLE_RANK": "0", "ROLE_NAME": "default",
    "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": "2",
    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_RESTART_COUNT": "0",
    "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_ERROR_FILE": "/tmp/err.json",
}


def test_helpers_started_under_torchrun_inherit_none_of_its_variables(tmp_path, monkeypatch):
    """Issue 42/1: a server inheriting TORCHELASTIC_USE_AGENT_STORE=True never hosts its
    own TP group's store; reward workers are no ranks either."""
    import areal_mcore.rollout.servers as launcher
    from areal_mcore.reward import pool

    for key, value in _TORCHRUN_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("KEEP_ME", "1")
    monkeypatch.setattr(launcher, "server_command", lambda cfg, *, port, seed: ["true"])
    monkeypatch.setattr(launcher, "_gpu_count", lambda: 0)
    envs = []
    monkeypatch.setattr(launcher, "ServerProcess", lambda cmd, **kw: envs.append(kw["env"]) or _Up())
    launcher.launch_servers(ServerConfig(model_path="/m", backend="sglang", log_dir=str(tmp_path)))
    launcher.launch_servers(ServerConfig(model_path="/m", log_dir=str(tmp_path)), env={**_TORCHRUN_ENV, "KEEP_ME": "1"})
    monkeypatch.setattr(pool.subprocess, "Popen", lambda cmd, **kw: envs.append(kw["env"]))
    pool._Worker(pool.RewardPoolConfig())
    assert len(envs) == 3
    for env in envs:
        assert env["KEEP_ME"] == "1" and not set(_TORCHRUN_ENV) & set(env), sorted(set(_TORCHRUN_ENV) & set(env))


_TCP_INIT_SERVER = """
import datetime, socket, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
import torch.distributed as dist
with socket.socket() as s:  # SGLang's TP group: tcp:// on a free port, this process rank 0
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                        timeout=datetime.timedelta(seconds=3))
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


@pytest.mark.server
def test_a_server_forming_its_own_tcp_group_comes_up_under_torchrun(tmp_path, monkeypatch):
    """Issue 42/1, end to end: a stub server that forms its process group as SGLang does
    (``tcp://``, rank 0) is healthy when launched from a torchrun rank."""
    import os
    import sys

    import areal_mcore.rollout.servers as launcher

    for key, value in _TORCHRUN_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(launcher, "server_command",
                        lambda cfg, *, port, seed: [sys.executable, "-c", _TCP_INIT_SERVER, str(port)])
    (server,) = launch_servers(ServerConfig(model_path="/m", log_dir=str(tmp_path), startup_timeout_s=60),
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    server.stop()


# ---------------------------------------------------------------------------- the API key

_KEY = "k3y-for-no-command-line"


def test_a_key_is_generated_when_none_is_configured_and_kept_owner_only(tmp_path, monkeypatch):
    import stat

    from areal_mcore.rollout.auth import KEY_ENV, configured_key, launch_key
    from areal_mcore.run_dir import RunDir

    monkeypatch.delenv(KEY_ENV, raising=False)
    run, cfg = RunDir(tmp_path / "run"), ServerConfig(model_path="/m")
    first, second = launch_key(cfg, run), launch_key(cfg, run)
    assert len(first) == 64 and first != second  # 256 bits, a new key at each launch
    assert run.rollout_key_file.read_text().strip() == second
    assert stat.S_IMODE(run.rollout_key_file.stat().st_mode) == 0o600
    assert configured_key(cfg) is None  # servers someone else started: no key unless given
    monkeypatch.setenv(KEY_ENV, "from-the-launcher")
    assert launch_key(cfg, run) == configured_key(cfg) == "from-the-launcher"
    assert launch_key(ServerConfig(model_path="/m", api_key="mine"), run) == "mine"
    assert run.rollout_key_file.read_text().strip() == second  # a given key is not written


@pytest.mark.parametrize("backend", ["embedded", "sglang", "vllm"])
def test_each_engine_gets_the_key_without_its_command_line(backend, tmp_path, monkeypatch):
    """Embedded: $AREAL_ROLLOUT_API_KEY and --weights-root; SGLang: a 0600 --config file;
    vLLM: VLLM_API_KEY and our guard of every route (--middleware, on PYTHONPATH)."""
    import os
    import stat

    import yaml

    import areal_mcore.rollout.servers as launcher
    from areal_mcore.rollout.auth import KEY_ENV
    from areal_mcore.rollout.engines.options import VLLMOptions
    from areal_mcore.rollout.engines.vllm import GUARD

    monkeypatch.setattr(launcher, "_gpu_count", lambda: 0)
    started = []
    monkeypatch.setattr(launcher, "ServerProcess", lambda cmd, **kw: started.append((cmd, kw["env"])) or _Up())
    vllm = {"vllm": VLLMOptions(kv_cache_memory_mb=64)} if backend == "vllm" else {}
    cfg = ServerConfig(model_path="/m", backend=backend, n_servers=2, log_dir=str(tmp_path / "logs"), **vllm)
    launcher.launch_servers(cfg, api_key=_KEY, weights_root=str(tmp_path))
    assert len(started) == 2 and not [a for cmd, _ in started for a in cmd if _KEY in a]
    cmd, env = started[0]
    if backend == "embedded":
        assert env[KEY_ENV] == _KEY and _flag(cmd, "--weights-root") == str(tmp_path)
    elif backend == "vllm":
        assert env["VLLM_API_KEY"] == _KEY and _flag(cmd, "--middleware") == GUARD
        module, _ = GUARD.rsplit(".", 1)
        plugin = env["PYTHONPATH"].split(os.pathsep)[0]
        assert os.path.isfile(os.path.join(plugin, *module.split(".")) + ".py")
    else:
        path = _flag(cmd, "--config")
        assert yaml.safe_load(open(path)) == {"api-key": _KEY}
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


@pytest.mark.parametrize("version", ["0.5.23", "0.5.20"])
def test_sglang_reads_the_key_from_the_launchers_config_file(version, tmp_path):
    """SGLang's own merge of ``--config`` (its wheel's ``ConfigArgumentMerger``, which
    ``prepare_server_args`` runs on ``sys.argv``) yields ``--api-key KEY`` in-process,
    while the process's arguments hold the file's path only."""
    import argparse
    import importlib

    from _sglang import wheel_modules

    from areal_mcore.rollout.engines.sglang import SGLangEngine

    cfg = ServerConfig(model_path="/m", backend="sglang")
    args, _ = SGLangEngine().auth(cfg, {}, api_key=_KEY, weights_root=None, private_dir=str(tmp_path))
    argv = server_command(cfg, port=5, seed=1)[3:] + args
    with wheel_modules(version):
        merger = importlib.import_module("sglang.srt.utils.server_args_config_parser").ConfigArgumentMerger
    parser = argparse.ArgumentParser()
    for flag in ("--config", "--api-key", "--model-path"):  # SGLang's spelling (arg_groups/arg_utils.py)
        parser.add_argument(flag)
    parsed, _ = parser.parse_known_args(merger(parser).merge_config_with_args(argv))
    assert parsed.api_key == _KEY and parsed.model_path == "/m"


def test_the_sglang_key_refuses_options_that_would_drop_it(tmp_path):
    from areal_mcore.rollout.engines.sglang import SGLangEngine

    for extra, why in [(["--config", "x.yaml"], "has --config"),
                       (["--tokenizer-worker-num", "2"], "checks the API key only with one tokenizer worker"),
                       (["--tokenizer-worker-num=4"], "sets --tokenizer-worker-num 4")]:
        cfg = ServerConfig(model_path="/m", backend="sglang", extra_args=extra)
        with pytest.raises(ValueError, match=rf"server.extra_args=.* {why}"):
            SGLangEngine().auth(cfg, {}, api_key=_KEY, weights_root=None, private_dir=str(tmp_path))
    with pytest.raises(ValueError, match="server.api_key='<hidden>' starts with '-'"):  # argparse's option
        SGLangEngine().auth(ServerConfig(model_path="/m", backend="sglang"), {}, api_key="-k3y",
                            weights_root=None, private_dir=str(tmp_path))


def test_our_vllm_guard_keys_every_route_but_health(monkeypatch):
    """vLLM's own check covers /v1, /v2, /inference and /cohere only; the guard the
    launcher adds (--middleware) covers the weight-update routes too."""
    import asyncio
    import os
    import sys

    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(__file__), "..", "plugins", "vllm_gloo_transfer"))
    from areal_vllm_gloo.guard import KeyOnEveryRoute

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    def status(path, auth=None, method="POST"):
        sent = []

        async def send(message):
            sent.append(message)
        headers = [(b"authorization", auth.encode())] if auth else []
        scope = {"type": "http", "method": method, "path": path, "root_path": "", "headers": headers}
        asyncio.run(guard(scope, None, send))
        return sent[0]["status"]

    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    with pytest.raises(RuntimeError, match="needs VLLM_API_KEY"):  # never a guard that lets all by
        KeyOnEveryRoute(app)
    monkeypatch.setenv("VLLM_API_KEY", _KEY)
    guard = KeyOnEveryRoute(app)
    for path in ("/init_weight_transfer_engine", "/update_weights", "/collective_rpc", "/pause",
                 "/inference/v1/generate"):
        assert [status(path), status(path, "Bearer wrong"), status(path, _KEY)] == [401, 401, 401]
        assert status(path, f"Bearer {_KEY}") == status(path, f"bearer {_KEY}") == 200
    assert status("/health", method="GET") == 200
    assert "areal_vllm_gloo" in sys.modules


def test_a_slurm_server_step_gets_the_launchers_key_by_its_environment(tmp_path, monkeypatch):
    """``launcher.slurm serve`` (an srun task) execs the server with the key the launcher
    put in its environment, never in the arguments, and the run directory as weights root."""
    import os

    from areal_mcore.launcher import slurm
    from areal_mcore.rollout.auth import KEY_ENV

    ran = []
    monkeypatch.setattr(slurm.os, "execve", lambda path, cmd, env: ran.append((cmd, env)))
    monkeypatch.setenv(KEY_ENV, _KEY)
    for backend in ("embedded", "sglang"):
        slurm.serve("configs/tiny_cpu.yaml", [f"trainer.log_dir={tmp_path}", "experiment_name=x",
                                              f"server.backend={backend}"], 0, "127.0.0.1", tmp_path)
    (embedded, env), (sglang, _) = ran
    assert not [a for cmd, _ in ran for a in cmd if _KEY in a]
    assert env[KEY_ENV] == _KEY and _flag(embedded, "--weights-root") == str((tmp_path / "x").absolute())
    assert "api-key" in open(_flag(sglang, "--config")).read()
    assert os.path.exists(tmp_path / "server_0.json")
