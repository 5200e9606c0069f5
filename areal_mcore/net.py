"""Small network helpers shared by the launchers, the weight syncer and the CLI (a leaf)."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (the OS picks it; another process may still
    take it before the caller binds, which callers accept for launch-time ports)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
