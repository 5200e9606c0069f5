"""Tiny HF checkpoints and embedded servers for the rollout tests."""

from __future__ import annotations

import contextlib
import os

from _tiers import needs
from _tiny_model import tiny_model

EOS = 7


def tiny_hf_dir(root: str, seed: int = 0, arch: str = "qwen2", **shape) -> str:
    """A seeded random model (Qwen2 unless ``arch`` says otherwise) saved as an HF directory
    (eos id ``EOS``); ``shape`` are ``tiny_model``'s keywords (``VLLM_SHAPE`` for what
    vLLM's CPU attention serves)."""
    tag = "".join(f"_{k}{v}" for k, v in sorted(shape.items()))
    path = os.path.join(root, f"tiny_hf_{seed}{tag}" if arch == "qwen2" else f"tiny_{arch}_{seed}{tag}")
    if not os.path.exists(os.path.join(path, "config.json")):
        _, _, model = tiny_model(arch, seed, **shape)
        model.config.eos_token_id = EOS
        model.generation_config.eos_token_id = EOS
        model.save_pretrained(path)
    return path


@contextlib.contextmanager
def rollout_servers(model_path: str, log_dir: str, n: int = 1, *, backend: str = "embedded",
                    grace_s: float = 5, **overrides):
    """``n`` servers of ``backend`` on ``model_path`` (fp32, 256-token context), stopped on exit."""
    from areal_mcore.rollout.config import ServerConfig
    from areal_mcore.rollout.servers import launch_servers

    needs("server")
    overrides = {"dtype": "float32", "context_length": 256, "startup_timeout_s": 120, **overrides}
    cfg = ServerConfig(model_path=model_path, backend=backend, n_servers=n, log_dir=log_dir, **overrides)
    servers = launch_servers(cfg, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        yield servers
    finally:
        for s in servers:
            s.stop(grace_s=grace_s)


embedded_servers = rollout_servers  # backend="embedded" is its default


def http(address: str, method: str, path: str, body: dict | None = None, *, key: str | None = None,
         timeout: float = 120):
    """(status, parsed JSON or text) of one request; never raises on HTTP errors."""
    import json
    import urllib.error
    import urllib.request

    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"http://{address}{path}", data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw) if raw else None
    except ValueError:
        return status, raw.decode()
