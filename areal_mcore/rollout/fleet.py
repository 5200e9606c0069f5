"""What an engine adapter (``rollout/engines/``) sees of the rollout servers: their list
and the calls it makes on them. ``RolloutClient`` is the fleet the run uses; adapters
depend on this interface, never on the client, so imports run one way: client ->
engines -> fleet (``tests/test_layering.py``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

from areal_mcore.rollout.protocol import LAST_OLD_API


@dataclass
class Server:
    """One server as the fleet tracks it (the adapters read and set the engine's facts)."""

    address: str
    in_flight: int = 0
    healthy: bool = True
    version: tuple[int, ...] = ()
    tp_size: int = 1
    dp_size: int = 1
    pp_size: int = 1
    last_answer: float = 0.0  # monotonic time of its last completion (or busy period's start)
    stalled: bool = False
    attempts: set = dataclasses.field(default_factory=set)  # generate attempts in flight

    @property
    def old_api(self) -> bool:
        # (0, 0, 0) is an SGLang built from source without metadata ("0.0.0.dev0"): new.
        return (0, 0, 0) < self.version <= LAST_OLD_API


class Fleet(Protocol):
    servers: list[Server]

    async def request(self, s: Server, method: str, path: str, body: dict | None = None, *,
                      timeout: float, parse: bool = True):
        """One call to one server; HTTP errors raise ``RolloutError``."""

    async def all(self, method: str, path: str, body: dict | None = None, *,
                  servers: list[Server] | None = None, timeout: float = 600.0,
                  fail_fast: bool = False) -> list:
        """The same call on every server (not stalled ones by default), concurrently."""

    async def each(self, servers: list[Server], calls: list, *, fail_fast: bool = False) -> list:
        """Awaits one call per server; one ``RolloutError`` names every server that failed."""
