"""A bearer-key check of every route of a vLLM server, for vLLM's ``--middleware`` option.

vLLM 0.32 checks ``--api-key`` / ``VLLM_API_KEY`` only on paths under ``/v1``, ``/v2``,
``/inference`` and ``/cohere`` (``entrypoints/serve/middleware/authenticate.py``,
``GUARDED_PREFIX``). With ``VLLM_SERVER_DEV_MODE=1`` the RL and dev routes a trainer needs
(``/init_weight_transfer_engine``, ``/update_weights``, ``/collective_rpc``, ``/pause``,
...) then answer anyone who reaches the port: any local user could replace the served
weights or make the server join a group at an address of their choosing.

vLLM adds the class ``--middleware`` names with ``app.add_middleware(cls)`` and no
arguments (``entrypoints/serve/middleware/register.py`` ``init_entrypoints_middleware``),
so the class reads the key from ``VLLM_API_KEY`` itself: areal-mcore's launcher sets both
(``rollout/engines/vllm.py`` ``VLLMEngine.auth``). Plain ASGI, standard library only: the
launcher puts this folder on ``PYTHONPATH`` where the plugin is not installed.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets

# The launcher's readiness probe (areal_mcore.net.healthy); vLLM's own check leaves it open too.
OPEN_PATHS = ("/health",)


class KeyOnEveryRoute:
    def __init__(self, app):
        key = os.environ.get("VLLM_API_KEY")
        if not key:  # fail closed: this middleware is asked for only with a key
            raise RuntimeError("areal_vllm_gloo.guard.KeyOnEveryRoute needs VLLM_API_KEY set: "
                               "without it every route of the server would be open")
        self.app = app
        self.digest = hashlib.sha256(key.encode()).digest()

    def allowed(self, scope) -> bool:
        # OPTIONS: a CORS preflight carries no credentials (vLLM's own check lets it by).
        if scope.get("method") == "OPTIONS":
            return True
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if path in OPEN_PATHS:
            return True
        for name, value in scope.get("headers", []):
            if name.lower() == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                # Digests of equal length, compared in constant time (as vLLM does).
                return scheme.lower() == "bearer" and secrets.compare_digest(
                    hashlib.sha256(token.encode("latin-1")).digest(), self.digest)
        return False

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket") or self.allowed(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":  # closing before accept refuses the handshake
            await send({"type": "websocket.close", "code": 1008})
            return
        body = json.dumps({"error": "Unauthorized"}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
